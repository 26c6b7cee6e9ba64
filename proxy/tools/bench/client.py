"""Send one bench request and time it: TTFT, gaps between content events, output tokens, errors."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from time import perf_counter

import orjson

from proxy.tools.bench.config import MAX_CONTENT_EVENTS
from proxy.tools.bench.prompts import Tokenizer
from proxy.tools.bench.sse import (
    MAX_EVENT_BYTES,
    SseEvent,
    SseParser,
    content_text,
    error_message,
    has_content,
    has_reasoning,
    is_done,
    usage_completion_tokens,
    usage_reasoning_tokens,
)
from proxy.tools.bench.transport import Transport, TransportFailure

__all__ = [
    "EVENTS",
    "TOKENIZER",
    "UNKNOWN",
    "USAGE",
    "RequestSample",
    "RequestSender",
]

USAGE = "usage"
TOKENIZER = "tokenizer"
EVENTS = "events (no usage, no tokenizer)"
UNKNOWN = "unknown (no usage, no tokenizer)"


@dataclass(slots=True)
class RequestSample:
    """One request's measurements; times are `perf_counter` seconds, None where not measured."""

    start_s: float
    end_s: float = 0.0
    error: str | None = None
    error_detail: str | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    output_tokens: int | None = None
    unstreamed_tokens: int = 0  # of output_tokens: reasoning usage counts that was never sent
    token_source: str = UNKNOWN
    content_events: int = 0
    gaps_s: list[float] = field(default_factory=list)

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.start_s

    @property
    def stream_tokens_per_s(self) -> float | None:
        """Generation speed after the first token: (tokens - 1) / (last - first); TTFT excluded,
        and so are tokens never streamed (hidden reasoning, generated before the first)."""
        if self.output_tokens is None or self.first_token_s is None or self.last_token_s is None:
            return None
        span_s = self.last_token_s - self.first_token_s
        streamed = self.output_tokens - self.unstreamed_tokens
        if streamed < 2 or span_s <= 0:
            return None
        return (streamed - 1) / span_s


class _StreamSink:
    """Times content events as reads arrive; JSON is parsed only for usage and errors."""

    __slots__ = (
        "_keep_text",
        "_max_events",
        "_parser",
        "done",
        "payloads",
        "reasoning_streamed",
        "reasoning_tokens",
        "sample",
        "status",
        "usage_tokens",
    )

    def __init__(self, sample: RequestSample, *, keep_text: bool, max_events: int) -> None:
        self.sample = sample
        self.status = 0
        self.usage_tokens: int | None = None
        self.reasoning_tokens = 0  # usage's count of them
        self.reasoning_streamed = False
        self.done = False
        self.payloads: list[bytes] = []
        self._keep_text = keep_text
        self._max_events = max_events
        self._parser = SseParser()

    def on_status(self, status: int) -> None:
        self.status = status

    def on_body(self, data: bytes, now_s: float) -> None:
        if self.status != 200:
            if len(self.payloads) < 8:
                self.payloads.append(data)
            return
        for event in self._parser.feed(data):
            self._on_event(event, now_s)

    def _on_event(self, event: SseEvent, now_s: float) -> None:
        data = event.data
        if is_done(data):
            self.done = True
            return
        message = error_message(event)
        if message is not None:
            self.sample.error, self.sample.error_detail = "stream_error", message
            return
        if has_content(data):
            sample = self.sample
            if sample.content_events >= self._max_events:  # past what was asked: keep nothing
                sample.content_events += 1
                return
            if sample.last_token_s is None:
                sample.first_token_s = now_s
            else:
                sample.gaps_s.append(now_s - sample.last_token_s)
            sample.last_token_s = now_s
            sample.content_events += 1
            if self._keep_text:
                self.payloads.append(data)
            if not self.reasoning_streamed:
                self.reasoning_streamed = has_reasoning(data)
        tokens = usage_completion_tokens(data)
        if tokens is not None:
            self.usage_tokens = tokens
            self.reasoning_tokens = usage_reasoning_tokens(data)

    def settle(self, tokenizer: Tokenizer | None, now_s: float) -> None:
        sample = self.sample
        if self.status != 200:
            sample.error = f"http_{self.status}"
            sample.error_detail = b"".join(self.payloads).decode("utf-8", "replace")[:200]
            return
        for event in self._parser.flush():
            self._on_event(event, now_s)
        if self._parser.dropped:
            sample.error = "oversized_event"
            sample.error_detail = (
                f"{self._parser.dropped} event(s) of more than {MAX_EVENT_BYTES:,} bytes, "
                "dropped unread"
            )
        if sample.content_events > self._max_events:
            sample.error = "too_many_events"
            sample.error_detail = (
                f"{sample.content_events:,} content events, more than the {self._max_events:,} "
                "the request's max_tokens allows (only those were timed)"
            )
        if sample.error is None and not self.done:
            sample.error = "incomplete"
            sample.error_detail = "stream ended without data: [DONE]"
        # A usage of 0 beside generated text is no count either.
        usage = self.usage_tokens if self.usage_tokens or not sample.content_events else None
        if usage is not None:
            sample.output_tokens, sample.token_source = usage, USAGE
            if not self.reasoning_streamed:  # counted in usage, thought before the first token
                sample.unstreamed_tokens = min(self.reasoning_tokens, usage)
        elif tokenizer is not None:
            text = "".join(content_text(data) for data in self.payloads)
            sample.output_tokens, sample.token_source = tokenizer.count(text), TOKENIZER
        else:
            sample.output_tokens, sample.token_source = sample.content_events, EVENTS


class _BodySink:
    """Collects a whole non-streamed response, up to MAX_EVENT_BYTES (then `oversized`)."""

    __slots__ = ("oversized", "parts", "size", "status")

    def __init__(self) -> None:
        self.status = 0
        self.parts: list[bytes] = []
        self.size = 0
        self.oversized = False

    def on_status(self, status: int) -> None:
        self.status = status

    def on_body(self, data: bytes, now_s: float) -> None:
        self.size += len(data)
        if self.size <= MAX_EVENT_BYTES:
            self.parts.append(data)
        elif not self.oversized:  # an endless body once grew the bench by 0.5 GB a second
            self.oversized, self.parts = True, []


class RequestSender:
    """Sends pre-encoded chat bodies through one transport; a failed request is a sample."""

    __slots__ = ("_max_events", "_timeout_s", "_tokenizer", "_transport")

    def __init__(
        self,
        transport: Transport,
        tokenizer: Tokenizer | None,
        timeout_s: float,
        *,
        max_events: int = MAX_CONTENT_EVENTS,
    ) -> None:
        self._transport = transport
        self._tokenizer = tokenizer
        self._timeout_s = timeout_s
        self._max_events = max_events

    async def send(self, body: bytes, *, stream: bool) -> RequestSample:
        sample = RequestSample(start_s=perf_counter())
        try:
            async with asyncio.timeout(self._timeout_s):
                if stream:
                    keep_text = self._tokenizer is not None
                    sink = _StreamSink(sample, keep_text=keep_text, max_events=self._max_events)
                    await self._transport.exchange(body, sink)
                    sink.settle(self._tokenizer, perf_counter())
                else:
                    whole = _BodySink()
                    await self._transport.exchange(body, whole)
                    if whole.oversized and whole.status == 200:
                        sample.error = "oversized_response"
                        sample.error_detail = f"more than {MAX_EVENT_BYTES:,} bytes, dropped unread"
                    else:
                        self._settle_unary(sample, whole.status, b"".join(whole.parts))
        except TimeoutError:
            sample.error, sample.error_detail = (
                "timeout",
                f"no complete answer in {self._timeout_s} s",
            )
        except TransportFailure as exc:
            sample.error, sample.error_detail = exc.kind, exc.detail
        sample.end_s = perf_counter()
        return sample

    def _settle_unary(self, sample: RequestSample, status: int, content: bytes) -> None:
        if status != 200:
            sample.error = f"http_{status}"
            sample.error_detail = content.decode("utf-8", "replace")[:200]
            return
        try:
            answer = orjson.loads(content)
        except orjson.JSONDecodeError:
            answer = None
        message = None if answer is None else error_message(SseEvent(data=content))
        if message is not None:
            sample.error, sample.error_detail = "error_body", message
            return
        if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
            sample.error = "bad_response"  # not JSON, or no chat completion
            sample.error_detail = content.decode("utf-8", "replace")[:200]
            return
        tokens = usage_completion_tokens(content)
        if tokens == 0 and content_text(content):  # a usage of 0 beside text is no count
            tokens = None
        if tokens is not None:
            sample.output_tokens, sample.token_source = tokens, USAGE
        elif self._tokenizer is not None:
            sample.output_tokens = self._tokenizer.count(content_text(content))
            sample.token_source = TOKENIZER
