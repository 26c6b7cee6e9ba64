"""The gateway's uvicorn protocol (proxy/asgi/protocol.py) under the name docs/operations.md
gives for running uvicorn directly: `--http proxy.web.slowclient:HeaderTimeoutProtocol`."""

from proxy.asgi.protocol import HeaderTimeoutProtocol, protocol_with_header_timeout

__all__ = ["HeaderTimeoutProtocol", "protocol_with_header_timeout"]
