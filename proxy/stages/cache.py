"""Answer repeats from the tenant's cache, exactly or by meaning; keep complete new answers.

Writes cache, cached (the answer to replay), cache_plan (on a miss), cache_similarity, and on a
hit input_tokens, output_tokens and saved_input_tokens / saved_output_tokens.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

import anyio
import orjson
from starlette.types import Send

from proxy.cache.answer import Answer, from_response
from proxy.cache.embed import Embedder, EmbedderUnavailable, QuestionUnseen, normalise
from proxy.cache.fold import StreamFold
from proxy.cache.key import CacheKey, cache_key
from proxy.cache.plan import CachePlan
from proxy.cache.replay import replay_response, replay_stream
from proxy.cache.semantic import SemanticIndex
from proxy.cache.verify import Reranker
from proxy.clock import Clock
from proxy.context import Admitted
from proxy.policy.model import Backend, CacheSpec
from proxy.stages.forward import SSE_HEADERS
from proxy.stages.prefetch import Plan, taken
from proxy.stages.storagepolicy import warned
from proxy.storage.base import StorageError
from proxy.storage.cache import CacheEntry, CacheStore
from proxy.storage.joint import Lookup
from proxy.together import nothing
from proxy.upstream.capture import Capture

__all__ = ["LookupPlan", "ResponseCache"]

_log = logging.getLogger("tokenweir.cache")
# A stream's SSE framing is several times its text; its capture may be this much larger.
_SSE_OVERHEAD = 16


@dataclass(slots=True)
class LookupPlan:
    """The exact lookup of the request's answer."""

    key: CacheKey
    step: Lookup

    @property
    def steps(self) -> tuple[Lookup]:
        return (self.step,)


class ResponseCache:
    """The lookup runs as a stage; `settle` stores a miss's answer once the request is over."""

    span_name: ClassVar[str] = "tokenweir.cache.lookup"
    given_back_at_settle: ClassVar[bool] = False  # a lookup holds nothing

    def __init__(
        self,
        store: CacheStore,
        clock: Clock,
        embedder: Embedder | None = None,
        *,
        embed_timeout_s: float = 2.0,
        backends: Callable[[], Sequence[Backend]] | None = None,
    ) -> None:
        self._store = store
        self._clock = clock
        self._embedder = embedder
        self._embed_timeout_s = embed_timeout_s
        # The verifier's backends (the policy serving now): whichever a tenant's
        # `cache.verifier.backend` names.
        verifier = Reranker(backends) if backends and embedder is not None else None
        self._index = SemanticIndex(store, verifier=verifier) if embedder is not None else None

    def touched(self, ctx: Admitted) -> bool:
        """The request was looked up (not bypassed)."""
        return ctx.cache != "bypass"

    async def __call__(self, ctx: Admitted) -> None:
        plan = taken(ctx, LookupPlan) or self.plan(ctx)
        if plan is None:
            return
        tenant, key = ctx.tenant, plan.key
        spec = tenant.cache
        # A second lookup in this request (a degradation rule's looser bar) reuses the vector,
        # and keeps the first's key and what it asked for: the rule may have changed the model
        # or the bound since, and such an answer is not stored under the key as first asked.
        cache_plan = ctx.cache_plan
        if cache_plan is None:
            cache_plan = CachePlan(key, asked=_asked(ctx))
        try:
            if not plan.step.taken:
                await plan.step.run(self._store)
            answer = self._fresh(plan.step.answer, ctx.cache_serve_stale)
            if answer is None and key.partition is not None:
                answer = await self._semantic(ctx, key, spec, cache_plan)
        except StorageError as exc:
            _log.warning("cache storage failed, serving without the cache: %s", exc)
            return
        if answer is None:
            ctx.cache, ctx.cache_plan = "miss", cache_plan
            self._capture(ctx, cache_plan, spec.max_entry_bytes * _SSE_OVERHEAD)
            return
        ctx.cache = "hit" if ctx.cache_similarity is None else "semantic-hit"
        ctx.cached = answer
        ctx.saved_input_tokens = answer.prompt_tokens
        ctx.saved_output_tokens = answer.completion_tokens
        charged = tenant.budget.charge_cache_hits
        ctx.input_tokens = answer.prompt_tokens if charged else 0
        ctx.output_tokens = answer.completion_tokens if charged else 0

    def plan(self, ctx: Admitted) -> LookupPlan | None:
        """The exact lookup, unless the cache is off for this tenant or request."""
        tenant = ctx.tenant
        if tenant.cache.mode == "off":
            return None
        if ctx.headers.get("x-tokenweir-cache", "").lower() == "bypass":
            return None
        key = cache_key(
            ctx.tenant_name, ctx.model, ctx.operation, ctx.body, tenant.cache, ctx.raw_body
        )
        if key is None:
            return None
        return LookupPlan(key, Lookup(key.tenant, key.exact, now=self._clock.wall()))

    def replan(self, ctx: Admitted, plan: Plan) -> bool:
        return False

    def _capture(self, ctx: Admitted, plan: CachePlan, limit: int) -> None:
        """A stream is folded as it passes (its bytes are not kept for it); a whole answer kept."""
        capture = ctx.capture
        if ctx.stream:
            plan.fold = StreamFold(limit)
            if capture is None:
                ctx.capture = Capture(0, plan.fold.feed)
                return
            capture.follower = plan.fold.feed
        if capture is None:
            ctx.capture = Capture(limit)
        else:
            capture.widen(limit)  # `log_content` keeps a stream this long too, as it always has

    def holding(self, ctx: Admitted) -> bool:
        return ctx.cache_plan is not None

    def settle(self, ctx: Admitted) -> Awaitable[None]:
        """Store a miss's answer if it is complete (a failed or cut-off one never is). An exact
        entry's store call is made now; the awaitable ends with it."""
        plan, ctx.cache_plan = ctx.cache_plan, None
        tenant = ctx.tenant
        if plan is None or not _complete(ctx) or _asked(ctx) != plan.asked:
            return nothing()
        answer = self._answer_of(ctx, plan, tenant.cache)
        if answer is None:
            return nothing()
        try:
            value = answer.encode(ctx.outcome.tail)
        except orjson.JSONEncodeError:
            # Nested past what orjson writes (254 levels; it reads 1,024): a raise here would
            # skip every other hold's settling (the request's slot, its reservation).
            return nothing()
        if len(value) > tenant.cache.max_entry_bytes:
            return nothing()
        # A tenant with a `cache: serve_stale` rule keeps answers one more ttl, to serve stale.
        stale = any(rule.then.cache == "serve_stale" for rule in tenant.degrade)
        entry = CacheEntry(
            plan.key.tenant, plan.key.exact, value, self._clock.wall(),
            tenant.cache.ttl * 2 if stale else tenant.cache.ttl,
            tenant.cache.max_entries, plan.partition,
        )  # fmt: skip
        question = plan.key.question
        if plan.vector is not None and question is not None and self._index and _by_meaning(answer):
            from proxy.cache.vectors import pack  # numpy: loaded once a question has a vector

            return self._put_with_vector(entry, pack(plan.vector, question), tenant.cache)
        return warned(self._store.put(entry), _log, "could not store an answer in the cache: %s")

    async def _put_with_vector(self, entry: CacheEntry, vector: bytes, spec: CacheSpec) -> None:
        """An entry findable by meaning, in the vector engine the tenant's spec chooses."""
        if self._index is not None:
            entry = replace(entry, vector=vector, graph=await self._index.graph(spec))
        await warned(self._store.put(entry), _log, "could not store an answer in the cache: %s")

    async def replay(self, ctx: Admitted, send: Send) -> None:
        """Send the hit the way the backend would have: one whole body, or SSE chunks."""
        answer = ctx.cached
        if answer is None:
            raise RuntimeError("replay needs a cache hit")
        created = int(self._clock.wall())
        if ctx.stream:
            body = replay_stream(answer, created, include_usage=ctx.client_wants_usage)
            headers = list(SSE_HEADERS)
        else:
            body = replay_response(answer, created)
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ]
        ctx.outcome.status = 200
        start = {"type": "http.response.start", "status": 200}
        await send({**start, "headers": [*headers, *ctx.gateway_headers()]})
        ctx.outcome.answered = True
        await send({"type": "http.response.body", "body": body, "more_body": False})
        ctx.meter.answered_locally(self._clock.monotonic(), streamed=ctx.stream)

    async def aclose(self) -> None:
        if self._index is not None:
            await self._index.aclose()
        if self._embedder is not None:
            await self._embedder.aclose()
        await self._store.aclose()

    async def _semantic(
        self, ctx: Admitted, key: CacheKey, spec: CacheSpec, plan: CachePlan
    ) -> Answer | None:
        if self._embedder is None or self._index is None or key.question is None:
            return None
        if plan.vector is None:
            try:
                with anyio.fail_after(self._embed_timeout_s):
                    plan.vector = await self._embedder.embed(normalise(key.question))
            except QuestionUnseen:
                return None  # the question's own trait, not the embedder's trouble: no warning
            except (EmbedderUnavailable, TimeoutError) as exc:
                _log.warning("embedder unavailable, semantic cache skipped: %s", exc)
                return None
        plan.partition = _scoped(self._embedder.name, key.partition or "")
        # A degradation rule may lower the bar for this request (never raise it).
        bar = min(spec.similarity, ctx.cache_min_similarity or spec.similarity)
        match = await self._index.nearest(
            key.tenant, plan.partition, plan.vector, key.question, bar, spec
        )
        if match is None:
            return None
        raw = await self._store.get(key.tenant, match.key, now=self._clock.wall())
        answer = self._fresh(raw, ctx.cache_serve_stale)
        if answer is None:
            self._index.forget(key.tenant, plan.partition, match.key)
            return None
        ctx.cache_similarity = match.similarity
        return answer

    def _fresh(self, raw: bytes | None, stale_ok: bool = False) -> Answer | None:
        if raw is None:
            return None
        answer = Answer.decode(raw)
        return answer if stale_ok or answer.expires_wall > self._clock.wall() else None

    def _answer_of(self, ctx: Admitted, plan: CachePlan, spec: CacheSpec) -> Answer | None:
        usage = ctx.outcome.usage or {
            "prompt_tokens": ctx.input_tokens or 0,
            "completion_tokens": ctx.output_tokens or 0,
            "total_tokens": (ctx.input_tokens or 0) + (ctx.output_tokens or 0),
        }
        if ctx.stream:
            answer = plan.fold.answer(ctx.operation, usage) if plan.fold is not None else None
        else:
            # The capture keeps the answer only if it fits an entry; it is parsed already.
            kept = ctx.capture is not None and ctx.capture.kept and ctx.outcome.as_sent
            body = ctx.outcome.parsed if kept else None
            answer = from_response(ctx.operation, body, usage) if body is not None else None
        if answer is None:
            return None
        return answer.expiring(self._clock.wall() + spec.ttl)


def _asked(ctx: Admitted) -> tuple[str, int | None]:
    """The model that answers and the bound on its answer."""
    return ctx.outgoing.model, ctx.outgoing.allowance


def _by_meaning(answer: Answer) -> bool:
    """An answer that may serve a reworded question: not a tool call, whose arguments are the
    question's own words and names (a reworded "email my boss" must not send the first one's
    email), and whose call ids would come back in another conversation."""
    return answer.message is None or not answer.message.get("tool_calls")


def _complete(ctx: Admitted) -> bool:
    return (
        ctx.cache == "miss"
        and ctx.status == 200
        and ctx.outcome.completed
        and ctx.error_code is None
        and not ctx.outcome.client_disconnected
    )


def _scoped(embedder: str, partition: str) -> str:
    """Vectors of two embedders never meet: the embedder is part of the partition's name."""
    return hashlib.sha256(f"{embedder}\0{partition}".encode()).hexdigest()[:40]
