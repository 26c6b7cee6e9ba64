"""The rate limits a request is admitted against: each scope's buckets and slot pools (on a
model, or on every model), built once from the limits object that makes them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final, TypeVar

from proxy.policy.model import Limits, LimitSet, Policy
from proxy.storage.limits import Bucket, LimitKey, SlotPool
from proxy.storage.scopes import scope_owner

__all__ = ["LimitShape", "LimitShapes", "Sizable", "limit_key", "per_minute", "sized_now"]

Sizable = TypeVar("Sizable", Bucket, SlotPool)
# Shapes kept at most (every tenant's and backend's, on each model with a limit of its own).
_MAX_SHAPES: Final = 4096


@dataclass(frozen=True, slots=True)
class LimitShape:
    """The buckets and slot pools of one limits object at one scope (and its limits on one
    model): they depend on nothing else, so they are built once; a request adds its costs."""

    scope: str
    limits: Limits | LimitSet  # what it was built from (a reloaded policy has new objects)
    buckets: tuple[Bucket, ...]
    counts_tokens: tuple[bool, ...]  # for each bucket: tokens, else requests
    slots: tuple[SlotPool, ...]
    request_buckets: tuple[Bucket, ...]  # the buckets that count requests (one each)

    @property
    def empty(self) -> bool:
        return not self.buckets and not self.slots

    @property
    def token_buckets(self) -> Iterator[tuple[int, Bucket]]:
        """The buckets that count tokens, each with its index."""
        for index, bucket in enumerate(self.buckets):
            if self.counts_tokens[index]:
                yield index, bucket

    def costs(self, tokens: int) -> list[int]:
        """This request's cost on each bucket: one request, `tokens` tokens."""
        return [tokens if counted else 1 for counted in self.counts_tokens]


class LimitShapes:
    """Each scope's `LimitShape` on each model (or on every model), built from the limits
    object asked with, and again when a later one is another object (a policy reload)."""

    __slots__ = ("_shapes",)

    def __init__(self) -> None:
        self._shapes: dict[tuple[str, str | None, bool], LimitShape] = {}

    def of(self, scope: str, limits: Limits | LimitSet, model: str) -> LimitShape:
        on_model = model if isinstance(limits, Limits) and model in limits.per_model else None
        return self._built(scope, limits, on_model, only_model=False)

    def of_model(self, scope: str, limits: Limits, model: str) -> LimitShape:
        """Only the limits on `model` (`per_model`, which has it), without the scope's own."""
        return self._built(scope, limits, model, only_model=True)

    def _built(
        self, scope: str, limits: Limits | LimitSet, model: str | None, *, only_model: bool
    ) -> LimitShape:
        shape = self._shapes.get((scope, model, only_model))
        if shape is None or shape.limits is not limits:
            if len(self._shapes) >= _MAX_SHAPES:
                self._shapes.clear()
            shape = _shape_of(scope, limits, model, only_model=only_model)
            self._shapes[scope, model, only_model] = shape
        return shape


def _shape_of(
    scope: str, limits: Limits | LimitSet, model: str | None, *, only_model: bool = False
) -> LimitShape:
    """The buckets and slot pools of `limits` (unless `only_model`), then those of its limits
    on `model`."""
    buckets: list[Bucket] = []
    slots: list[SlotPool] = []
    levels: list[tuple[str | None, Limits | LimitSet]] = [] if only_model else [(None, limits)]
    if model is not None and isinstance(limits, Limits):
        levels.append((model, limits.per_model[model]))
    for on_model, level in levels:
        for bucket, _ in per_minute(
            scope, level.requests_per_minute, level.tokens_per_minute, 0, model=on_model
        ):
            buckets.append(bucket)
        if level.max_concurrent:
            slots.append(LimitKey(scope, "slots", on_model).pool(level.max_concurrent))
    counts_tokens = tuple(limit_key(bucket).kind == "tokens" for bucket in buckets)
    requests = tuple(b for b, tokens in zip(buckets, counts_tokens, strict=True) if not tokens)
    return LimitShape(scope, limits, tuple(buckets), counts_tokens, tuple(slots), requests)


def per_minute(
    scope: str,
    requests: int | None,
    tokens_per_minute: int | None,
    tokens: int,
    *,
    model: str | None = None,
) -> Iterator[tuple[Bucket, int]]:
    """The requests- and tokens-per-minute buckets of `scope` (on `model`, or on every model),
    each with this request's cost (one request, `tokens` tokens)."""
    if requests:
        yield LimitKey(scope, "requests", model).bucket(requests), 1
    if tokens_per_minute:
        yield LimitKey(scope, "tokens", model).bucket(tokens_per_minute), tokens


def limit_key(limit: Bucket | SlotPool) -> LimitKey:
    """Which limit a bucket or pool of this stage is (each is built from its LimitKey)."""
    if limit.name is None:
        raise ValueError(f"{limit.key} was not built from a LimitKey")
    return limit.name


def sized_now(policy: Policy | None, limit: Sizable) -> Sizable:
    """`limit` (a bucket or a slot pool) as `policy`, the one serving now, sizes it: the shared
    state of a request admitted, or waiting in line, under an earlier policy is used at the new
    limit (a tokens_per_minute raised from 1,000 to 1,000,000 fell back to about 1,000 as each
    stream admitted before the reload ended; a request waiting for a slot waited for the old
    max_concurrent). As it was if `policy` (None: not known) has no such limit any more."""
    if policy is None:
        return limit
    name = limit_key(limit)
    level: Limits | LimitSet | None = None
    match scope_owner(name.scope):  # None: a runtime key's own (its limits do not change)
        case ("backend", backend):
            level = next((b.limits for b in policy.backends if b.name == backend), None)
        case ("tenant", tenant_name):
            tenant = policy.tenants.get(tenant_name)
            level = tenant.limits if tenant is not None else None
            if level is not None and name.model is not None:
                level = level.per_model.get(name.model)
    if level is None:
        return limit
    if isinstance(limit, SlotPool):
        size = level.max_concurrent
        return limit if not size or size == limit.size else name.pool(size)
    now = level.tokens_per_minute if name.kind == "tokens" else level.requests_per_minute
    return limit if not now or now == limit.capacity else name.bucket(now)
