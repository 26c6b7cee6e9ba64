"""The bench's one-method seam to the network: POST a body, feed the response into a sink.

Two implementations: `wire` (HTTP/1.1 on asyncio and httptools, the default, cheap per
event) and `httpx_transport` (httpx: proxies from the environment, but ~5x the CPU per SSE event).
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["ResponseSink", "Transport", "TransportFailure"]


class ResponseSink(Protocol):
    """Receives one response as it arrives; `now_s` is the perf_counter time of the read."""

    def on_status(self, status: int) -> None: ...

    def on_body(self, data: bytes, now_s: float) -> None: ...


class Transport(Protocol):
    async def exchange(self, body: bytes, sink: ResponseSink) -> None:
        """POST `body` to the chat endpoint and feed the whole response to `sink`.

        Raises TransportFailure when no complete response arrives; cancellation (the caller's
        timeout) must leave the transport usable for other requests.
        """
        ...

    async def aclose(self) -> None: ...


class TransportFailure(Exception):
    """No complete response: `kind` is "connection" or "timeout", `detail` says what happened."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail[:200]
