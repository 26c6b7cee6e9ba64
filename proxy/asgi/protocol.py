"""uvicorn's httptools protocol with a deadline on each request's line and headers (slowloris),
lending each request's scope its response cycle for a stream's direct writes
(proxy/asgi/direct.py).

uvicorn times out idle keep-alive connections but not a client that dribbles its headers; this
protocol answers such a client 408 in OpenAI's shape and closes the connection.
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any, cast

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from proxy.asgi.direct import lend_cycle
from proxy.errors import RequestTimeout

__all__ = ["HeaderTimeoutProtocol", "protocol_with_header_timeout"]


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """The timer starts when the connection opens or a request's first byte arrives, and stops
    when that request's headers are complete; the body has its own limit (`read_body`). A
    request whose headers come whole in the read that begins it (nearly all) gets no timer: it
    is set once that read is parsed, only if the headers are not complete by then (a loop timer
    made and cancelled per request cost more than the check)."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        header_timeout_s: float = 10.0,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._header_timeout_s = header_timeout_s
        self._header_timer: asyncio.TimerHandle | None = None
        self._in_head = False  # a request's first byte came, its headers are not all here

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_head and self._header_timer is None:
            self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        super().on_headers_complete()
        lend_cycle(self.scope, self.cycle)

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self._header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        error = RequestTimeout(
            f"The request headers did not arrive within {self._header_timeout_s:g} s."
        )
        body = error.to_json()
        head = (
            b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
        )
        self.transport.write(head + body)
        self.transport.close()


def protocol_with_header_timeout(header_timeout_s: float) -> type[asyncio.Protocol]:
    """What to pass as uvicorn's `http=`: picklable, so `--workers N` processes receive it."""
    factory = partial(HeaderTimeoutProtocol, header_timeout_s=header_timeout_s)
    return cast(type[asyncio.Protocol], factory)
