"""Upstream stream-through: send the request to the chosen backend and relay its answer as it comes.

Writes the outcome (status, whether the answer came whole, its tail, the backend's usage)
and the meter.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any, Final

import httpx
from starlette.types import Send

from proxy.apis import AGENT_APIS, EventForwarder
from proxy.asgi.direct import DirectBody, direct_body
from proxy.clock import Clock
from proxy.context import Admitted
from proxy.errors import (
    GatewayError,
    UpstreamBadResponse,
    UpstreamError,
    UpstreamTimeout,
    UpstreamTooLarge,
)
from proxy.policy.model import Backend, UpstreamSpec
from proxy.stages.shown import (
    Reshow,
    added_usage_chunk,
    event_with_billed,
    usage_chunk_if_overruled,
    whole_with_billed,
)
from proxy.stages.stored import answer_id, stored_id
from proxy.stages.usage import believed
from proxy.stages.usage import take_usage as _take_usage
from proxy.stages.usage import usage_of as _usage_of
from proxy.telemetry.recorder import Telemetry
from proxy.upstream.client import UpstreamOpener, close, raw_reads, read_capped, translate
from proxy.upstream.deadline import ContentDeadline
from proxy.upstream.exchange import Exchange, Sink
from proxy.upstream.prebuilt import header_bytes
from proxy.upstream.sse import ChoicesForwarder, SSEForwarder
from proxy.upstream.wellformed import EVENT_STREAM, FirstEvent, MalformedAnswer, read_answer

__all__ = ["SSE_HEADERS", "Forward"]

_EVENT_STREAM: Final = EVENT_STREAM.encode()

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_DATA: Final = b"data:"
# A stream's last bytes kept for its span (response model, finish reasons): its last reads, cut
# to this where one read held much of the stream, so the span's regexes stay O(1) a stream.
_STREAM_TAIL_BYTES: Final = 8192


class Forward:
    def __init__(
        self, upstream: UpstreamOpener, clock: Clock, telemetry: Telemetry, spec: UpstreamSpec
    ) -> None:
        self._upstream = upstream
        self._clock = clock
        self._telemetry = telemetry
        self._spec = spec

    async def __call__(self, ctx: Admitted, send: Send) -> None:
        # The agent APIs' streams always carry usage; only chat and completions must ask.
        asking = ctx.stream and ctx.operation not in AGENT_APIS
        body = _asking_for_usage(ctx.body) if asking else ctx.body
        ctx.meter.sending_upstream(self._clock.monotonic())
        trace_headers = self._telemetry.upstream_started(ctx)
        try:
            backend, response = await self._upstream.open(ctx, body, trace_headers)
        except GatewayError as exc:
            self._telemetry.upstream_ended(ctx, None, exc.code or exc.type)
            raise
        try:
            if ctx.stream:
                await self._relay_stream(ctx, backend, response, send)
            else:
                await self._relay_whole(ctx, backend, response, send)
        finally:
            # Closing a half-read response drops its connection, which stops the backend.
            with ctx.scope.shielded():
                await close(response)
            error = None if ctx.outcome.completed else ctx.error_code or "incomplete"
            self._telemetry.upstream_ended(ctx, response.status_code, error)

    async def _relay_stream(
        self, ctx: Admitted, backend: Backend, response: httpx.Response, send: Send
    ) -> None:
        api = AGENT_APIS.get(ctx.operation)
        sse: SSEForwarder | EventForwarder
        # Usage the client sees is held, to be shown as billed: the gateway counts the output
        # relayed too, and a backend's output count below it is billed as counted
        # (`counted_output`); its event ends the stream anyway. One believed in a chunk with
        # choices (llama.cpp's last) goes on as it came, a chunk of the bill after it if
        # overruled.
        if api is not None:
            sse = EventForwarder(api.events, _held)
        elif ctx.choices > 1:
            completions = ctx.operation == "text_completion"
            sse = ChoicesForwarder(
                keep_usage=ctx.client_wants_usage, completions=completions, believed=_held
            )
        else:
            shown = partial(believed, ctx) if ctx.client_wants_usage else None
            sse = SSEForwarder(keep_usage=ctx.client_wants_usage, believed=shown, hold=True)
        relay = _Relay(ctx, backend, sse, self._content_deadline(ctx, backend), self._clock)
        ending = b""
        outcome = ctx.outcome
        stream = response.stream
        body: DirectBody | None = None
        try:
            with translate(backend):
                chunks = raw_reads(response)
                held = await _first_events(backend, response, chunks, relay.content, relay.clock)
                if ctx.route is not None:
                    ctx.route.answering()
                held.reverse()
                while True:
                    # The held first reads, then the stream's own: read straight from it, not
                    # through httpx's aiter_raw (two generators and a chunker a token).
                    if held:
                        raw = held.pop()
                    else:
                        try:
                            raw = await chunks.__anext__()
                        except StopAsyncIteration:
                            break
                    out, token_events = relay.take(raw)
                    if out:
                        if not outcome.status:  # per chunk: a field, not ctx's property
                            await self._start(ctx, send, SSE_HEADERS)
                            body = direct_body(ctx.server_cycle)
                            if body is not None and isinstance(stream, Exchange):
                                stream.relay_to(relay.direct(body))
                        # A client whose socket is full makes `send` wait: its wait, not ours.
                        full_s = None if body is None or body.ready() else relay.clock()
                        await send({"type": "http.response.body", "body": out, "more_body": True})
                        relay.sent(out, token_events, full_s)
            if (
                sse.cut_short()
                if isinstance(sse, EventForwarder)
                else not sse.closed_whole(relay.before_last + relay.last)
            ):
                # Broken off as a dropped connection is: the client must not take it as whole.
                raise UpstreamBadResponse(
                    f"backend {backend.name!r} ended the stream before its last event"
                )
            ending = sse.finish()
            if ctx.capture is not None:
                ctx.capture.add(ending)
            ctx.outcome.completed = True
            ctx.outcome.reshow = _reshown(ctx, sse)
            if isinstance(sse, SSEForwarder):
                last = sse.textless(relay.before_last) + sse.textless(relay.last)
                ctx.meter.textless_at_end = last
            elif sse.failed:
                # Ended as the backend ended it, with its own error event: an error to the
                # ledger and metrics, as a stream the gateway breaks off is.
                ctx.outcome.error_code = "upstream_error"
        except UpstreamError as exc:
            if not ctx.status:
                raise  # nothing sent yet: the client gets a proper error status instead
            ctx.outcome.error_code = exc.code
            # An OpenAI-shaped error event, and no [DONE]: the client must not take it as complete.
            # A usage event held to be shown as billed goes out before it.
            ending = sse.held + b"data: " + exc.to_json() + b"\n\n"
            if sse.held:
                ctx.outcome.reshow = _reshown(ctx, sse)
        finally:
            if not outcome.completed:  # broken off: the backend failed, or the client left
                _textless_at_break(ctx, sse, relay)
        if not ctx.status:
            await self._start(ctx, send, SSE_HEADERS)
        ctx.outcome.answered = True
        ctx.outcome.tail = (relay.before_last + relay.last)[-_STREAM_TAIL_BYTES:] + ending
        _take_usage(ctx, sse.usage)
        if isinstance(sse, EventForwarder):
            ctx.outcome.stored_id = stored_id(ctx, sse.answer_id)
        await send({"type": "http.response.body", "body": ending, "more_body": False})

    async def _relay_whole(
        self, ctx: Admitted, backend: Backend, response: httpx.Response, send: Send
    ) -> None:
        limit = self._spec.max_response_bytes
        with translate(backend):
            raw = await read_capped(response, limit)
        if raw is None:
            raise UpstreamTooLarge(
                f"backend {backend.name!r} answered with more than upstream.max_response_bytes "
                f"({limit} bytes)"
            )
        try:
            parsed, ctx.outcome.as_sent = read_answer(ctx.operation, raw)
            ctx.outcome.parsed = parsed
        except MalformedAnswer as exc:
            raise UpstreamBadResponse(f"backend {backend.name!r} answered 200, but {exc}") from None
        ctx.meter.read(self._clock.monotonic())
        ctx.outcome.completed = True
        if ctx.capture is not None:
            ctx.capture.add(raw)
        ctx.outcome.tail = raw
        _take_usage(ctx, _usage_of(parsed))
        headers = [(b"content-type", b"application/json")]
        if ctx.outcome.backend_usage is None or ctx.choices > 1:
            # Its usage may be the gateway's count, known only once settled: so is its length.
            ctx.outcome.reshow = whole_with_billed(parsed, raw, as_sent=ctx.outcome.as_sent)
        else:
            headers.append((b"content-length", str(len(raw)).encode()))
        await self._start(ctx, send, headers)
        ctx.outcome.answered = True
        if ctx.operation in AGENT_APIS:
            ctx.outcome.stored_id = stored_id(ctx, answer_id(ctx.operation, parsed))
        if ctx.operation == "responses" and parsed.get("status") == "failed":
            ctx.outcome.error_code = "upstream_error"  # at 200, as a stream's response.failed
        await send({"type": "http.response.body", "body": raw, "more_body": False})
        # No first token to time: a whole answer's comes with its last (an embedding has none).
        ctx.meter.wrote(self._clock.monotonic(), 1, False)

    def _content_deadline(self, ctx: Admitted, backend: Backend) -> ContentDeadline:
        spec = self._spec
        first_s = backend.first_byte_timeout or spec.first_byte_timeout or spec.read_timeout
        meter = ctx.meter  # from the request sent to this backend (after a failover too)
        sent_s = meter.attempt_sent_s if meter.attempt_sent_s is not None else meter.upstream_sent_s
        if sent_s is None:  # set as Forward begins; a test may drive _relay_stream alone
            sent_s = self._clock.monotonic()
        return ContentDeadline(sent_s, first_s, spec.read_timeout)

    async def _start(self, ctx: Admitted, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        ctx.outcome.status = 200
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [*headers, *ctx.gateway_headers()],
            }
        )


def _textless_at_break(ctx: Admitted, sse: SSEForwarder | EventForwarder, relay: _Relay) -> None:
    """The events without text in a broken-off stream's last sent read, where that read held
    text: each took a token's place in the count of the reads with text, as at a stream's end
    (a finish event beside the last word, before the client left)."""
    if isinstance(sse, SSEForwarder) and relay.last_texted:
        ctx.meter.textless_at_end = sse.textless(relay.last)


class _Relay:
    """One stream's relay, read by read: what the read sends on (the meter, the SSE accounting,
    the content deadline), and what a sent chunk leaves behind (its time, the stream's tail, the
    capture). Fed by the relay's task, or, while the task waits, by the backend connection's
    callback writing straight to the client (`direct`, proxy/asgi/direct.py)."""

    __slots__ = ("_backend", "_capture", "_meter", "_sse", "before_last", "clock", "content",
                 "last", "last_texted")  # fmt: skip

    def __init__(
        self,
        ctx: Admitted,
        backend: Backend,
        sse: SSEForwarder | EventForwarder,
        content: ContentDeadline,
        clock: Clock,
    ) -> None:
        self._backend = backend
        self._capture = None if ctx.capture is None else ctx.capture.tap()
        self._meter = ctx.meter
        self._sse = sse
        self.content = content
        self.clock = clock.monotonic
        self.before_last = self.last = b""
        self.last_texted = False

    def take(self, raw: bytes) -> tuple[bytes, int]:
        """The bytes to send on for a read, and the token events they hold."""
        now_s = self.clock()
        self._meter.read(now_s)
        out, token_events = self._sse.feed(raw)
        # Content: an event with text, else any data event (`find`, not `in`: see
        # proxy/cache/template.py plain).
        if token_events or out.find(_DATA) >= 0:
            self.content.content(now_s)
        elif self.content.passed(now_s):
            raise _no_content(self._backend)
        return out, token_events

    def sent(self, out: bytes, token_events: int, full_s: float | None = None) -> None:
        """`out` reached the client; `full_s`: when its socket was full, from which `send`
        waited for the client to read (no time of the gateway's own)."""
        now_s = self.clock()
        self._meter.wrote(now_s, token_events, self._sse.texted)
        if full_s is not None:
            self._meter.client_was_slow(now_s - full_s)
        self.before_last, self.last = self.last, out
        self.last_texted = self._sse.texted
        if self._capture is not None:
            self._capture(out)

    def direct(self, body: DirectBody) -> Sink:
        """The sink for the backend's reads while the task waits: each goes to the client at
        once if its connection can take it, else (False) to the task, whose send waits."""

        def sink(raw: bytes) -> bool:
            if not body.ready():
                return False
            out, token_events = self.take(raw)
            if out:
                body.write(out)
                self.sent(out, token_events)
            return True

        return sink


async def _first_events(
    backend: Backend,
    response: httpx.Response,
    chunks: AsyncIterator[bytes],
    content: ContentDeadline,
    monotonic: Callable[[], float],
) -> list[bytes]:
    """The reads up to a stream's first data event, held until it is judged: a stream that is
    not `text/event-stream`, or whose first event is no JSON object, is a 502 before any byte
    goes to the client."""
    content_type = header_bytes(response.headers, b"content-type")
    if not content_type.strip().lower().startswith(_EVENT_STREAM):
        shown = content_type[:80].decode("latin-1")
        raise UpstreamBadResponse(
            f"backend {backend.name!r} answered a stream with content-type {shown!r}"
        )
    check = FirstEvent()
    reads: list[bytes] = []
    async for raw in chunks:
        reads.append(raw)
        if check.feed(raw):
            break
        if content.passed(monotonic()):
            raise _no_content(backend)
    else:
        check.end()
    if check.problem is not None:
        message = f"backend {backend.name!r} answered a stream, but {check.problem}"
        raise UpstreamBadResponse(message)
    return reads


def _no_content(backend: Backend) -> UpstreamTimeout:
    return UpstreamTimeout(
        f"backend {backend.name!r} sent no content (only comments or blank lines) within the "
        "read timeout"
    )


def _held(usage: dict[str, Any]) -> bool:
    """Believed or not, a usage the gateway may overrule with its own output count (several
    answers', an agent API stream's) is held until billed."""
    return False


def _reshown(ctx: Admitted, sse: SSEForwarder | EventForwarder) -> Reshow | None:
    """How a stream's end shows the bill: in place of a usage the client saw held back, or,
    where it asked for usage and the backend sent none (or none it could show), in a usage chunk
    of its own."""
    if sse.held:
        return event_with_billed(sse.held, sse.held_chunk if isinstance(sse, SSEForwarder)
                                 else sse.held_event)  # fmt: skip
    if ctx.client_wants_usage and isinstance(sse, SSEForwarder):
        if sse.usage is None or sse.unshown:
            return added_usage_chunk
        if sse.passed:
            return usage_chunk_if_overruled
    return None


def _asking_for_usage(body: dict[str, Any]) -> dict[str, Any]:
    """The body with `stream_options.include_usage` on: the backend's usage is the bill."""
    options = body.get("stream_options")
    options = dict(options) if isinstance(options, dict) else {}
    options["include_usage"] = True
    return {**body, "stream_options": options}
