"""`tokenweir mock-backend`: a simulated OpenAI-compatible LLM server for tests, demos, benchmarks.

Routes: POST /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/rerank (rerank.py),
/v1/responses and /v1/messages (OpenAI's Responses and Anthropic's Messages, agents.py);
GET and DELETE /v1/responses/{id} (stored responses, kept.py); GET /v1/models, /mock/stats;
POST /mock/stats/reset. Answers are deterministic pseudo-text seeded
by the prompt, one word per token and per SSE event. Token i is due at arrival + ttft + i /
tokens_per_second; a late stream sends every due token in one write, never early. A non-stream
answer arrives when its last token would. Usage counts are the mock's own: whitespace-split words
(+4 per chat message for prompts). A whole answer has `n` choices for each prompt of a
completions batch, alike; a stream sends them side by side, each token of every choice in
turn (an event each, with the choice's `index`), as vLLM and OpenAI stream `n` > 1;
`max_tokens` / `max_completion_tokens` cut each short (finish_reason "length"), as
`max_output_tokens` does a response (status "incomplete") and `max_tokens` a message
(stop_reason "max_tokens"). `stop` ends a chat or text completion where a sequence first
occurs, as vLLM does (text.py stopped).
`stream_options` without `stream` is a 400, as in OpenAI and vLLM. Chat's `logprobs` (with
`top_logprobs`), completions' `logprobs` and a response's `include` of
"message.output_text.logprobs" are answered with each token's (logprobs.py).
Errors on /v1/messages are Anthropic-shaped. A request with function `tools` may be answered
with tool calls, as a model decides by `tool_choice`: on chat `tool_calls` (toolcalls.py), on
Responses `function_call` items and on Messages `tool_use` blocks (agentcalls.py), each streamed
in its API's events.

Testing knobs, as extra fields in the request body:
  mock_fail: 400-599            answer with that status and an OpenAI-shaped error
  mock_retry_after_s: N         with mock_fail, also send `Retry-After: N`
  mock_fail_after_tokens: N     streams only: send N tokens, then drop the connection mid-body
  mock_delay_ms: N              wait N ms before the first byte (the headers) of any answer
  mock_completion_tokens: N     the answer's natural length (default 256, finish_reason "stop";
                                at most 131,072)
  mock_tool_calls: N            a tool-calling answer makes N parallel calls (1-16; default 1)

Simulations (create_app arguments and `tokenweir mock-backend` flags): `load_ttft_ms` adds that
much TTFT per other request in flight; `prefill_ms_per_1k_tokens` adds prefill time for prompt
tokens not in the simulated KV prefix cache, an LRU of `prefix_cache` leading-system-message
prefixes (see sim.py). `fail_status` and `fail_after_tokens` apply the knobs of the same
name to every request that does not set them (a backend that always fails, or always dies).

GET /mock/stats: streams_started, streams_completed (sent [DONE]), streams_cancelled (client left
mid-stream), streams_aborted (mock_fail_after_tokens), requests_total (/v1 requests but
models_listed: GET /v1/models, which gateways' health probes send on their own clock),
requests_cancelled (client left before the answer began), tokens_sent, inflight, prefix_hits and
prefix_misses (the simulated prefix cache), and the last counted request's parsed JSON body
(`last_request`) and Authorization (`last_authorization`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Final

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.clock import Clock, SystemClock
from proxy.tools.mock.answers import embedding_answer, parse_request, stream_format, whole_answer
from proxy.tools.mock.asgi import (
    ClientGone,
    left_within,
    read_body,
    respond,
    respond_error,
    run_lifespan,
)
from proxy.tools.mock.kept import KeptResponses, Transcript, finished_response
from proxy.tools.mock.request import (
    CompletionRequest,
    Endpoint,
    Knobs,
    MockHTTPError,
    parse_embedding,
    parse_json,
    parse_knobs,
)
from proxy.tools.mock.rerank import rerank_answer
from proxy.tools.mock.sim import Faults, LoadModel
from proxy.tools.mock.stats import MockStats
from proxy.tools.mock.stream import Outcome, Schedule, StreamRun, Ticker
from proxy.tools.mock.text import TokenSource

__all__ = ["MockStats", "create_app"]

_SSE_HEADERS: Final = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]


class MockBackend:
    """The ASGI app; per-process state (stats, ticker) lives on the instance."""

    def __init__(
        self,
        *,
        ttft_s: float,
        interval_s: float,
        models: Sequence[str],
        clock: Clock,
        load: LoadModel | None = None,
        faults: Faults | None = None,
    ) -> None:
        self.stats = MockStats()
        self._load = load
        self._faults = faults or Faults()
        self._ttft_s = ttft_s
        self._interval_s = interval_s
        self._models = tuple(models)
        self._clock = clock
        self._ticker = Ticker(clock)
        self._kept = KeptResponses()
        self._routes: dict[tuple[str, str], Handler] = {
            ("POST", "/v1/chat/completions"): self._generating(Endpoint.CHAT),
            ("POST", "/v1/completions"): self._generating(Endpoint.COMPLETIONS),
            ("POST", "/v1/embeddings"): self._embeddings,
            ("POST", "/v1/responses"): self._generating(Endpoint.RESPONSES),
            ("POST", "/v1/messages"): self._generating(Endpoint.MESSAGES),
            ("POST", "/v1/rerank"): self._rerank,
            ("GET", "/v1/models"): self._list_models,
            ("GET", "/mock/stats"): self._get_stats,
            ("POST", "/mock/stats/reset"): self._reset_stats,
        }
        self._paths = {path for _, path in self._routes}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await run_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        if path == "/v1/models" and scope["method"] == "GET":
            self.stats.models_listed += 1
        elif path.startswith("/v1/"):
            self.stats.requests_total += 1
            auth = dict(scope["headers"]).get(b"authorization")
            self.stats.last_authorization = None if auth is None else auth.decode("latin-1")
        handler = self._routes.get((scope["method"], path))
        if handler is None and KeptResponses.serves(path):
            handler = self._stored
        try:
            if handler is None:
                raise self._no_route(scope["method"], path)
            await handler(scope, receive, send)
        except MockHTTPError as error:
            await respond_error(send, error, anthropic=path == "/v1/messages")
        except ClientGone:
            self.stats.requests_cancelled += 1

    def _no_route(self, method: str, path: str) -> MockHTTPError:
        if path in self._paths:
            return MockHTTPError(405, f"Method {method} not allowed on {path}.")
        return MockHTTPError(404, f"Unknown request URL: {method} {path}.")

    async def _json_body(self, receive: Receive) -> dict[str, Any]:
        raw = await read_body(receive)
        self.stats.last_request = None
        body = parse_json(raw)
        self.stats.last_request = body
        return body

    @contextlib.asynccontextmanager
    async def _inflight(self, receive: Receive) -> AsyncIterator[asyncio.Future[Any]]:
        """Count the request as in flight; yields a future that is done once the client leaves."""
        self.stats.inflight += 1
        watcher = asyncio.ensure_future(receive())
        try:
            yield watcher
        finally:
            watcher.cancel()
            self.stats.inflight -= 1

    async def _left_during_delay(
        self, watcher: asyncio.Future[Any], knobs: Knobs, arrival_s: float
    ) -> bool:
        """Apply mock_delay_ms, then mock_fail; True if the client left during the delay."""
        if await left_within(watcher, arrival_s + knobs.delay_s - self._clock.monotonic()):
            self.stats.requests_cancelled += 1
            return True
        if knobs.fail_status is not None:
            raise MockHTTPError(
                knobs.fail_status,
                f"Simulated failure (mock_fail={knobs.fail_status}).",
                code="mock_fail",
                retry_after_s=knobs.retry_after_s,
            )
        return False

    def _generating(self, endpoint: Endpoint) -> Handler:
        async def handle(scope: Scope, receive: Receive, send: Send) -> None:
            await self._completion(receive, send, endpoint)

        return handle

    async def _completion(self, receive: Receive, send: Send, endpoint: Endpoint) -> None:
        arrival_s = self._clock.monotonic()
        body = await self._json_body(receive)
        knobs = self._faults.apply(parse_knobs(body))
        history = self._kept.history(body) if endpoint is Endpoint.RESPONSES else None
        request = parse_request(body, endpoint, history)
        async with self._inflight(receive) as watcher:
            if await self._left_during_delay(watcher, knobs, arrival_s):
                return
            tokens, n_tokens, finish_reason = request.plan(knobs)
            schedule = Schedule(
                first_due_s=arrival_s
                + knobs.delay_s
                + self._ttft_s
                + self._extra_ttft_s(body, request.prompt_tokens),
                interval_s=self._interval_s,
                n_tokens=n_tokens,
            )
            answer = (tokens, request, body, schedule, finish_reason)
            if request.stream:
                await self._stream(send, watcher, knobs, *answer)
            else:
                await self._complete(send, watcher, *answer)

    def _extra_ttft_s(self, body: dict[str, Any], prompt_tokens: int) -> float:
        load = self._load
        if load is None:
            return 0.0
        extra_s = load.extra_ttft_s(body, prompt_tokens, self.stats.inflight - 1)
        self.stats.prefix_hits, self.stats.prefix_misses = load.prefix_hits, load.prefix_misses
        return extra_s

    async def _stream(
        self,
        send: Send,
        watcher: asyncio.Future[Any],
        knobs: Knobs,
        tokens: TokenSource,
        request: CompletionRequest,
        body: dict[str, Any],
        schedule: Schedule,
        finish_reason: str,
    ) -> None:
        created = int(self._clock.wall())
        fmt = stream_format(request, body, created, tokens, schedule.n_tokens, finish_reason)
        stream = StreamRun(
            send=send,
            fmt=fmt,
            tokens=tokens,
            schedule=schedule,
            ticker=self._ticker,
            clock=self._clock,
            fail_after_tokens=knobs.fail_after_tokens,
        )
        watcher.add_done_callback(stream.on_disconnect)
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        self.stats.streams_started += 1
        outcome = Outcome.CANCELLED
        try:
            outcome = await stream.run()
            if outcome is Outcome.COMPLETED:
                self._keep(request, body, fmt.tail, tokens, schedule.n_tokens)
        finally:
            self.stats.tokens_sent += stream.sent * request.answers
            self.stats.count_outcome(outcome)
        # After an ABORTED run we return without ending the body: the server drops the connection.

    async def _complete(
        self,
        send: Send,
        watcher: asyncio.Future[Any],
        tokens: TokenSource,
        request: CompletionRequest,
        body: dict[str, Any],
        schedule: Schedule,
        finish_reason: str,
    ) -> None:
        n_tokens = schedule.n_tokens
        done_s = schedule.due_s(n_tokens - 1)
        if await left_within(watcher, done_s - self._clock.monotonic()):
            self.stats.requests_cancelled += 1
            return
        created = int(self._clock.wall())
        answer = whole_answer(request, body, created, tokens, n_tokens, finish_reason)
        await respond(send, 200, answer)
        self.stats.tokens_sent += n_tokens * request.answers
        self._keep(request, body, answer, tokens, n_tokens)

    def _keep(
        self,
        request: CompletionRequest,
        body: dict[str, Any],
        sent: bytes,
        tokens: TokenSource,
        n_tokens: int,
    ) -> None:
        """Store a Responses answer sent whole (`sent`: it, or a stream's tail), as OpenAI
        does unless the request said `store: false` (kept.py)."""
        if request.endpoint is Endpoint.RESPONSES and body.get("store") is not False:
            response = finished_response(sent) if request.stream else sent
            prompt = Transcript(request.prompt_text, request.prompt_tokens)
            self._kept.keep(response, prompt, tokens.completion(n_tokens), n_tokens)

    async def _stored(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, self._kept.answer(scope["method"], scope["path"]))

    async def _embeddings(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrival_s = self._clock.monotonic()
        body = await self._json_body(receive)
        knobs = self._faults.apply(parse_knobs(body))
        request = parse_embedding(body)
        async with self._inflight(receive) as watcher:
            if not await self._left_during_delay(watcher, knobs, arrival_s):
                await respond(send, 200, embedding_answer(request))

    async def _rerank(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrival_s = self._clock.monotonic()
        body = await self._json_body(receive)
        knobs = self._faults.apply(parse_knobs(body))
        answer = rerank_answer(body)  # rerank.py
        async with self._inflight(receive) as watcher:
            if await self._left_during_delay(watcher, knobs, arrival_s):
                return
            if not await left_within(
                watcher, arrival_s + knobs.delay_s + self._ttft_s - self._clock.monotonic()
            ):
                await respond(send, 200, answer)

    async def _list_models(self, scope: Scope, receive: Receive, send: Send) -> None:
        data = [
            {"id": model, "object": "model", "created": 0, "owned_by": "tokenweir-mock"}
            for model in self._models
        ]
        await respond(send, 200, orjson.dumps({"object": "list", "data": data}))

    async def _get_stats(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, self.stats.to_json())

    async def _reset_stats(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.stats.reset()
        await respond(send, 200, self.stats.to_json())


def create_app(
    *,
    ttft_ms: float = 0.0,
    tokens_per_second: float = 750.0,
    models: Sequence[str] = ("mock-llm", "mock-embed"),
    clock: Clock | None = None,
    load_ttft_ms: float = 0.0,
    prefill_ms_per_1k_tokens: float = 0.0,
    prefix_cache: int = 0,
    fail_status: int | None = None,
    fail_after_tokens: int | None = None,
) -> ASGIApp:
    """The mock backend as an ASGI app; `tokens_per_second` may be `math.inf` (unpaced).

    The simulations and faults are described in the module docstring."""
    delays = {"ttft_ms": ttft_ms, "load_ttft_ms": load_ttft_ms}
    delays["prefill_ms_per_1k_tokens"] = prefill_ms_per_1k_tokens
    for name, value in delays.items():  # a negative one would send tokens before they are due
        if not 0 <= value < math.inf:
            raise ValueError(f"{name} must be a number >= 0, got {value}")
    if not tokens_per_second > 0:
        raise ValueError(f"tokens_per_second must be > 0, got {tokens_per_second}")
    if prefix_cache < 0:
        raise ValueError(f"prefix_cache must be >= 0, got {prefix_cache}")
    return MockBackend(
        ttft_s=ttft_ms / 1000.0,
        interval_s=1.0 / tokens_per_second,
        models=models,
        clock=clock or SystemClock(),
        load=LoadModel(
            load_ttft_s=load_ttft_ms / 1000.0,
            prefill_s_per_token=prefill_ms_per_1k_tokens / 1e6,
            prefix_cache_size=prefix_cache,
        )
        if load_ttft_ms or prefill_ms_per_1k_tokens
        else None,
        faults=Faults(fail_status, fail_after_tokens),
    )
