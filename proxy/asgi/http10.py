"""An HTTP/1.0 client's answer of unknown length (a stream), sent as HTTP/1.0 frames it: as it
comes, ended by closing the connection (uvicorn sent it chunked, which HTTP/1.0 does not have)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

if TYPE_CHECKING:
    from uvicorn._types import ASGISendEvent

__all__ = ["Http10Cycle", "close_delimited"]

_FRAMING: Final = frozenset({b"content-length", b"transfer-encoding"})


class Http10Cycle(RequestResponseCycle):
    """An HTTP/1.0 request's cycle: an answer of unknown length (a stream) goes out as it comes,
    ended by closing the connection, as HTTP/1.0 frames it. uvicorn sent it with chunked
    framing, which HTTP/1.0 does not have: its client read the chunk sizes as part of the body."""

    _unframed = False  # the answer has no length: its body goes out as it is

    async def send(self, message: ASGISendEvent) -> None:
        if message["type"] == "http.response.start" and not self.response_started:
            framed = {name.lower() for name, _ in message.get("headers", ())}
            if not framed & _FRAMING and self.scope["method"] != "HEAD":
                self._unframed = True
                self.chunked_encoding = False  # uvicorn's send then frames it by its length
        elif self._unframed and message["type"] == "http.response.body":
            # As long as this piece: uvicorn's send counts it down to 0 and writes it as it is.
            self.expected_content_length = len(message.get("body", b""))
        await super().send(message)


def close_delimited(cycle: RequestResponseCycle, scope: object) -> None:
    """Make `cycle`, the HTTP/1.0 request's whose head just came, an Http10Cycle."""
    if cycle.scope is scope and type(cycle) is RequestResponseCycle:
        cycle.__class__ = Http10Cycle  # before its task's first step calls its `send`
