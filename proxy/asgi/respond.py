"""Writing whole answers to an ASGI `send`: JSON bodies and OpenAI-shaped errors."""

from __future__ import annotations

from collections.abc import Sequence

from starlette.types import Send

from proxy.errors import GatewayError

__all__ = ["RawHeaders", "send_error", "send_json"]

RawHeaders = Sequence[tuple[bytes, bytes]]


async def send_json(send: Send, status: int, body: bytes, headers: RawHeaders = ()) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(send: Send, error: GatewayError, headers: RawHeaders = ()) -> None:
    extra = [(k.encode(), v.encode()) for k, v in error.headers().items()]
    await send_json(send, error.status, error.to_json(), [*headers, *extra])
