"""uvicorn's httptools protocol with a deadline on each request's line and headers (slowloris),
lending each request's scope its response cycle (proxy/asgi/direct.py), and telling the running
request from `connection_lost` that its client left (`watch_client`).

uvicorn times out idle keep-alive connections but not a client that dribbles its headers (408 here,
in OpenAI's shape, connection closed), nor bounds their size (431 past MAX_HEAD_BYTES, still coming
or whole in a read). Bytes that are not HTTP/1.1 (request smuggling, a bad chunk size) are a 400 in
OpenAI's shape, as is an HTTP/1.1 request without exactly one Host (RFC 9112 3.2). Each refusal
goes out after the answers owed to the requests before it (pipelined), never into a stream's
middle. A request answered before its body all came (401, 413, 408) has the rest dropped within
the header deadline, else the connection is closed; one that asked `Expect: 100-continue` and was
answered before it was told to send its body closes the connection. Also: at most MAX_PIPELINED
requests wait behind the one being answered; a request offering an upgrade (h2c) is read with its
body (proxy/asgi/upgrade.py); a chunked body's trailers do not join the headers; an HTTP/1.0
client's stream goes unframed (proxy/asgi/http10.py); a client reading nothing for the stall
timeout is cut off; a body that left uvicorn's reading paused (past 64 KiB) has it resumed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from random import getrandbits
from typing import Any, cast

import httptools
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from proxy.asgi.direct import LentCycle, lend_cycle
from proxy.asgi.http10 import close_delimited
from proxy.asgi.refusals import (
    head_fault,
    headers_too_large,
    malformed,
    status_line,
    too_many_pipelined,
)
from proxy.asgi.stall import StallWatch
from proxy.asgi.upgrade import body_framing, parser_for_body
from proxy.errors import GatewayError, RequestTimeout

__all__ = [
    "MAX_HEAD_BYTES",
    "HeaderTimeoutProtocol",
    "protocol_with_header_timeout",
    "watch_client",
]

# What a request's line and headers may take in the reads after the one that begins them (which
# is at most one read, 256 KiB, more). Browsers and SDKs send a few KiB; nginx's default is 32 KiB.
MAX_HEAD_BYTES = 64 * 1024
# Requests parsed and waiting behind the one being answered (pipelined): uvicorn parses a whole
# read (256 KiB, 9,000 requests of 28 bytes, 10-20 MB of state) at once. No SDK pipelines.
MAX_PIPELINED = 16


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
        stall_timeout_s: float | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._header_timeout_s = header_timeout_s
        # A client that reads nothing of what is written to it for this long is cut off.
        self._stall = None if stall_timeout_s is None else StallWatch(self.loop, stall_timeout_s)
        self._header_timer: asyncio.TimerHandle | None = None
        self._in_head = False  # a request's first byte came, its headers are not all here
        self._head_bytes = 0  # of the reads of the headers after the first
        self._reading = self._began_in = 0  # the bytes of this read; of the read a request began in
        self._watched: RequestResponseCycle | None = None  # the cycle `_gone` watches
        self._gone: Callable[[], None] | None = None
        # Answered before its body all came: the rest is read and dropped until `_linger_timer`.
        self._refused: RequestResponseCycle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        # Asked `Expect: 100-continue`: its answer closes the connection unless its body came
        # first; `_keep_alive` is what it keeps once it has.
        self._expecting: RequestResponseCycle | None = None
        self._keep_alive = False
        self._refusing = False  # a refusal that closes the connection is sent, or to be in turn
        self._refusal: GatewayError | None = None  # why the parser was stopped, if the protocol did

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._end_linger()
        if self._stall is not None:
            self._stall.stop()
        super().connection_lost(exc)
        gone, watched = self._gone, self._watched
        self._gone = self._watched = None
        if gone is not None and watched is not None and not watched.response_complete:
            # uvicorn marks only the cycle it parsed last: with a request pipelined behind it,
            # not the one being answered, which wrote on to the closed connection (and raised).
            watched.disconnected = True
            watched.message_event.set()
            gone()

    def pause_writing(self) -> None:
        """The client's socket is full: unless it reads within the stall timeout, the connection
        is cut and its request told its client left (proxy/asgi/stall.py)."""
        super().pause_writing()
        if self._stall is not None:
            self._stall.paused(self.transport)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall is not None:
            self._stall.stop()

    def watch(self, cycle: RequestResponseCycle, gone: Callable[[], None]) -> None:
        """Call `gone` if the connection is lost before `cycle`'s response is complete."""
        self._watched, self._gone = cycle, gone
        if self.flow.read_paused and not cycle.more_body and not (self.pipeline or self._refusing):
            # uvicorn pauses reading while more than 64 KiB of body waits for the app, and only
            # the app's next `receive` resumes it: a body whose last read took it past that left
            # the connection unread, so its loss was never seen (a client that left a stream
            # whose backend paused held the backend, its slot and reservation until a timeout).
            self.flow.resume_reading()

    def unwatch(self, gone: Callable[[], None]) -> None:
        """Stop the watch `gone` began (a later request's watch on the connection stays)."""
        if self._gone is gone:
            self._gone = self._watched = None

    def data_received(self, data: bytes) -> None:
        was_in_head, self._reading = self._in_head, len(data)
        self._feed(data)
        if self._refused is not None or self._expecting is not None:
            self._body_moved()
        elif (cycle := self.cycle) is not None and cycle.response_complete and cycle.more_body:
            self._linger(cycle)
        if not self._in_head:
            return
        if was_in_head:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._disarm()
                self._refuse_in_turn(
                    b"431 Request Header Fields Too Large", headers_too_large(MAX_HEAD_BYTES)
                )
                return
        if self._header_timer is None:
            self._arm()

    def _feed(self, data: bytes) -> None:
        """uvicorn's `data_received`, except that a request offering an upgrade this server does
        not make is read as a request like any other: its body, and the requests after it."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")
        except httptools.HttpParserUpgrade as upgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._not_upgraded(data[upgrade.args[0] :])

    def _not_upgraded(self, rest: bytes) -> None:
        """The request is at the end of its head; `rest` is what came after it in this read."""
        cycle = self.cycle
        framing = body_framing(self.scope["headers"])
        if framing is not None and cycle is not None and cycle.scope is self.scope:
            # llhttp skipped the body, and said the request was whole: it is not, yet (its task
            # has not run: this is the read that ended its head).
            cycle.more_body = True
            cycle.message_event.clear()
            self.parser, head = parser_for_body(self)
            rest = head + framing + b"\r\n\r\n" + rest
        if rest:
            self._feed(rest)  # httptools's parser is ready for the next request

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_bytes, self._began_in = 0, self._reading

    def on_message_complete(self) -> None:
        if self.cycle.response_complete:  # uvicorn leaves an answered body "coming" for ever:
            self.cycle.more_body = False  # the linger then closed the connection in use
        super().on_message_complete()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        reads = self._began_in + self._head_bytes + self._reading
        version = self.parser.get_http_version()
        self._refusal = head_fault(self.url, self.headers, reads, version, MAX_HEAD_BYTES)
        if self._refusal is not None:
            raise _StopParsing  # before a cycle is made: a parser error (400, 431) in turn
        previous = self.cycle
        super().on_headers_complete()
        if self.pipeline and len(self.pipeline) > MAX_PIPELINED:
            self.pipeline.popleft()  # this one: the 400 answers it, after those before it
            self.cycle = previous
            self._refusal = too_many_pipelined(MAX_PIPELINED)
            raise _StopParsing  # llhttp stops at this request: a parser error (400) in turn
        # A chunked body's trailer fields come to uvicorn's `on_header` as headers do: put in a
        # list of their own, they do not join the request's (the scope's) headers. A trailer's
        # `authorization` authenticated a request, past a proxy that checks the header section.
        self.headers = []
        if self.scope["http_version"] == "1.0":
            close_delimited(self.cycle, self.scope)  # and nothing lent: uvicorn's send frames
        else:
            lend_cycle(self.scope, self.cycle)
        if self.expect_100_continue:
            self._expect(self.cycle)

    def _get_upgrade(self) -> bytes | None:
        """uvicorn's, read from the scope's headers (`self.headers` has a body's trailers only)."""
        connection: list[bytes] = []
        upgrade = None
        for name, value in self.scope["headers"]:
            if name == b"connection":
                connection = [token.lower().strip() for token in value.split(b",")]
            elif name == b"upgrade":
                upgrade = value.lower()
        return upgrade if b"upgrade" in connection else None

    def shutdown(self) -> None:
        self._expecting = None  # the connection closes after its answer, as uvicorn set
        super().shutdown()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes that are not HTTP/1.1, in OpenAI's shape (or to a request
        the protocol stopped the parser at, with `_refusal`)."""
        error = self._refusal or malformed()
        self._refuse_in_turn(status_line(error), error)

    def _refuse_in_turn(self, status: bytes, error: GatewayError) -> None:
        """Refuse the request that is coming (and close the connection) once the requests before
        it on the connection (pipelined) have their answers: one still being sent (a stream)
        is neither cut nor has the refusal written into its middle."""
        if self._refusing:
            return  # sent already, or to be once what is owed has gone
        self._refusing = True
        self._in_head = False
        self._disarm()
        cycle = self.cycle
        owed = (
            cycle is not None
            and not cycle.response_complete
            and (cycle.response_started or not cycle.more_body)  # not bytes of its own body
            and not self.transport.is_closing()
        )
        if not owed:
            self._refuse(status, error)
            return
        self.flow.pause_reading()
        last = self.pipeline[0][0] if self.pipeline else cycle  # appended left, popped right
        last.on_response = partial(self._after_the_owed, last, status, error)

    def _after_the_owed(
        self, cycle: RequestResponseCycle, status: bytes, error: GatewayError
    ) -> None:
        self.on_response_complete()
        if self.transport.is_closing():
            return  # that answer closed the connection (`connection: close`, HTTP/1.0)
        # Through the cycle's transport: it may hold its answer still (proxy/asgi/held.py).
        self._refuse(status, error, cycle.transport)

    def _expect(self, cycle: RequestResponseCycle) -> None:
        """Until its body has come, an answer to `cycle` closes the connection: its client
        waits to be told to send it, so the bytes after the answer would be its next request."""
        if cycle.scope is not self.scope:
            return  # the protocol answers it itself (an upgrade)
        self._settle_expecting()
        self._expecting, self._keep_alive = cycle, cycle.keep_alive
        cycle.keep_alive = False

    def _settle_expecting(self) -> None:
        expecting = self._expecting
        if expecting is not None and not expecting.more_body:
            self._expecting = None
            if not expecting.response_started:
                expecting.keep_alive = self._keep_alive

    def _linger(self, cycle: RequestResponseCycle) -> None:
        """`cycle` was answered before its body all came (a refusal): the rest is dropped as it
        comes, but within the header deadline, else the connection is closed (uvicorn would
        read it for ever, and its keep-alive timer stops at each read)."""
        if self.transport.is_closing():
            return
        self._refused = cycle
        self._linger_timer = self.loop.call_later(self._header_timeout_s, self._linger_over)

    def _body_moved(self) -> None:
        self._settle_expecting()
        refused = self._refused
        if refused is None or refused.more_body:
            return
        self._end_linger()
        if self.cycle is refused and not self._in_head and not self.transport.is_closing():
            # Idle again: uvicorn's keep-alive timer, which the reads of the body stopped.
            self._unset_keepalive_if_required()
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    def _linger_over(self) -> None:
        self._linger_timer = None
        if self._refused is not None:
            self._refused = None
            self.transport.close()

    def _end_linger(self) -> None:
        self._refused = None
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None

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
        self._refuse_in_turn(b"408 Request Timeout", error)

    def _refuse(
        self, status: bytes, error: GatewayError, transport: asyncio.Transport | None = None
    ) -> None:
        """Answer `error` and close the connection; on `transport`, the cycle's that may still hold
        the answer before it, or else the connection's own."""
        transport = transport or self.transport
        self._in_head = False
        body = error.to_json()
        # Every answer carries `x-request-id`: a new one, as proxy/web/requestid.py makes it.
        head = (
            b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"x-request-id: req_%032x\r\nconnection: close\r\n\r\n"
            % (status, len(body), getrandbits(128))
        )
        transport.write(head + body)
        transport.close()


class _StopParsing(Exception):
    """Raised in a parser callback to stop llhttp where it is (it is then in error)."""


def watch_client(lent: LentCycle | None, gone: Callable[[], None]) -> HeaderTimeoutProtocol | None:
    """Have the request's connection call `gone` from its `connection_lost` if the client leaves
    before the response is complete; returns the protocol to `unwatch` it on. None where the
    server lent no cycle of this protocol, or the client has left already: the caller then
    watches `receive` for `http.disconnect` in a task of its own, as under any ASGI server."""
    cycle = None if lent is None else lent()
    if cycle is None or cycle.disconnected:
        return None
    protocol = cycle.transport.get_protocol()
    if not isinstance(protocol, HeaderTimeoutProtocol):
        return None
    protocol.watch(cycle, gone)
    return protocol


def protocol_with_header_timeout(
    header_timeout_s: float, stall_timeout_s: float | None = None
) -> type[asyncio.Protocol]:
    """What to pass as uvicorn's `http=`: picklable, so `--workers N` processes receive it."""
    factory = partial(
        HeaderTimeoutProtocol, header_timeout_s=header_timeout_s, stall_timeout_s=stall_timeout_s
    )
    return cast(type[asyncio.Protocol], factory)
