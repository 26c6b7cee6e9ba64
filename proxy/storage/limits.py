"""The rate-limit contract: token buckets and leased concurrency slots, admitted all-or-nothing.

The verdict (who refused, how long to wait, what the headers say) is computed here, once, from
the numbers each implementation reads atomically; implementations only read, check and apply.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal, Protocol

__all__ = [
    "SLOT_RETRY_S",
    "Admission",
    "Bucket",
    "BucketState",
    "LimitKey",
    "LimitStore",
    "SlotPool",
    "bucket_state",
    "check_scope",
    "judge",
    "refilled",
]

SLOT_RETRY_S = 1.0  # a full slot pool frees when some generation ends: no time can be computed
_SUFFIXES: Final = {"requests": "rpm", "tokens": "tpm", "slots": "slots"}


@dataclass(frozen=True, slots=True)
class LimitKey:
    """Which rate limit a bucket or slot pool is: whose (`scope`, with its hash tag), what it
    counts, and on which model (None: on every model). Its store key is derived from these,
    `<scope>:rl[:m:<model>]:rpm|tpm|slots`, and nothing reads them back out of a key."""

    scope: str
    kind: Literal["requests", "tokens", "slots"]
    model: str | None = None

    @property
    def key(self) -> str:
        level = f"{self.scope}:rl" if self.model is None else f"{self.scope}:rl:m:{self.model}"
        return f"{level}:{_SUFFIXES[self.kind]}"

    def bucket(self, per_minute: int) -> Bucket:
        """The bucket of a per-minute limit: bursts up to it, refills it over a minute."""
        return Bucket(self.key, per_minute, per_minute / 60.0, name=self)

    def pool(self, size: int) -> SlotPool:
        return SlotPool(self.key, size, name=self)


@dataclass(frozen=True, slots=True)
class Bucket:
    """A token bucket: holds up to `capacity` (the burst), refills `refill_per_s` continuously."""

    key: str  # e.g. "tw:{tenant}:rl:rpm": the tenant's hash tag keeps a request's keys together
    capacity: int  # the per-minute limit
    refill_per_s: float  # capacity / 60 normally
    # The limit it is (LimitKey.bucket); stores read only `key`, and bare buckets have none.
    name: LimitKey | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if self.capacity < 0 or not self.refill_per_s > 0:
            raise ValueError(f"bucket {self.key}: capacity >= 0 and refill_per_s > 0 required")


@dataclass(frozen=True, slots=True)
class SlotPool:
    """At most `size` leases (in-flight generations) at once."""

    key: str
    size: int
    name: LimitKey | None = field(default=None, kw_only=True)  # as Bucket's


@dataclass(slots=True)
class BucketState:
    """One bucket as OpenAI's x-ratelimit-* headers show it."""

    limit: int
    remaining: int  # whole units left after this admission (>= 0)
    reset_s: float  # seconds until the bucket is full again


@dataclass(slots=True)
class Admission:
    """The verdict on one request.

    `refused` indexes buckets then slot pools; a limit the request can never fit (a cost above
    a bucket's capacity, a pool of size 0) takes precedence over the first limit that refused,
    and makes `retry_after_s` infinite. Otherwise `retry_after_s` is the wait until every
    refusing limit could admit (the longest one), or SLOT_RETRY_S when only a pool is full.
    """

    admitted: bool
    refused: int | None
    retry_after_s: float  # 0 when admitted; math.inf when the request can never be admitted
    buckets: tuple[BucketState, ...]
    # live leases in each slot pool before this admission, across every replica
    held: tuple[int, ...] = ()

    @property
    def never(self) -> bool:
        """True when retrying is pointless: the request is larger than a limit."""
        return math.isinf(self.retry_after_s)

    def by_slot(self, buckets: Sequence[Bucket]) -> bool:
        """Refused by a slot pool (of those after `buckets`), not by a bucket."""
        return self.refused is not None and self.refused >= len(buckets)


class LimitStore(Protocol):
    """Rate-limit state shared by the gateway's replicas.

    `now` is the caller's wall clock (seconds), never the store's: one clock for every decision
    keeps tests on a fake clock and Redis scripts deterministic. The cost is clock skew between
    replicas: a bucket never refills backwards (its timestamp only moves forward), so a replica
    whose clock runs d seconds ahead grants at most d * refill_per_s tokens early, and purges
    other replicas' slot leases up to d seconds early; keep lease TTLs well above the skew.
    Every key must start with `scope` (the tenant's prefix with its hash tag). `settle`,
    `release` and `renew` are sent when called, not when awaited (Redis sends the calls of one
    turn of the event loop together): a caller with several makes them all, then awaits them.
    """

    async def admit(
        self,
        scope: str,
        buckets: Sequence[Bucket],
        costs: Sequence[int],
        slots: Sequence[SlotPool],
        *,
        lease_id: str,
        lease_until: float,
        now: float,
    ) -> Admission:
        """Charge every bucket its cost and take a slot (leased until `lease_until`) in every
        pool, or change nothing. Expired leases in the pools are released first."""

    def settle(self, scope: str, bucket: Bucket, delta: int, *, now: float) -> Awaitable[None]:
        """Charge `delta` more tokens (may go negative: later requests wait) or refund them
        (delta < 0; never above capacity)."""

    def release(self, scope: str, slots: Sequence[SlotPool], *, lease_id: str) -> Awaitable[None]:
        """Give the lease's slots back; releasing an unknown or expired lease does nothing."""

    def renew(
        self, scope: str, slots: Sequence[SlotPool], *, lease_id: str, lease_until: float
    ) -> Awaitable[bool]:
        """Extend the lease in every pool; False (and nothing changes) if any pool has already
        released it (it expired and a later admission purged it, or was released)."""

    async def peek(
        self, scope: str, buckets: Sequence[Bucket], *, now: float
    ) -> tuple[BucketState, ...]:
        """The buckets as they stand at `now`, charging nothing."""

    async def held(self, scope: str, slots: Sequence[SlotPool], *, now: float) -> tuple[int, ...]:
        """The live leases in each pool at `now`, across every replica, taking none."""

    async def aclose(self) -> None: ...


def refilled(bucket: Bucket, tokens: float, ts: float, now: float) -> tuple[float, float]:
    """(tokens, timestamp) at `now`; a clock behind `ts` adds nothing and keeps `ts`.

    The Lua scripts do the same arithmetic in the same order, so both stores agree exactly.
    """
    if now > ts:
        tokens += (now - ts) * bucket.refill_per_s
        ts = now
    return min(float(bucket.capacity), tokens), ts


def bucket_state(bucket: Bucket, tokens: float) -> BucketState:
    reset_s = max(0.0, (bucket.capacity - tokens) / bucket.refill_per_s)
    return BucketState(bucket.capacity, max(0, math.floor(tokens)), reset_s)


def judge(
    buckets: Sequence[Bucket],
    costs: Sequence[int],
    tokens: Sequence[float],
    slots: Sequence[SlotPool],
    held: Sequence[int],
) -> Admission:
    """The verdict on refilled `tokens` per bucket and live leases `held` per pool.

    Admitted iff tokens >= cost for every bucket and held < size for every pool (the same
    check the stores apply).
    """
    if _admits(buckets, costs, tokens, slots, held):  # nearly every request: no waits to weigh
        after = zip(buckets, costs, tokens, strict=True)
        states = tuple([bucket_state(b, t - c) for b, c, t in after])
        return Admission(True, None, 0.0, states, tuple(held))
    waits = [_bucket_wait(b, c, t) for b, c, t in zip(buckets, costs, tokens, strict=True)]
    waits += [_slot_wait(pool, n) for pool, n in zip(slots, held, strict=True)]
    longest = max(waits, default=0.0)
    refused = waits.index(longest) if math.isinf(longest) else _first_positive(waits)
    states = tuple(bucket_state(b, t) for b, t in zip(buckets, tokens, strict=True))
    return Admission(False, refused, longest, states, tuple(held))


def check_scope(scope: str, keys: Iterable[str]) -> None:
    """Refuse keys outside `scope`: in Redis Cluster one script may only touch one slot."""
    for key in keys:
        if not key.startswith(scope):
            raise ValueError(f"key {key!r} is outside scope {scope!r}")


def _admits(
    buckets: Sequence[Bucket],
    costs: Sequence[int],
    tokens: Sequence[float],
    slots: Sequence[SlotPool],
    held: Sequence[int],
) -> bool:
    """Every bucket holds its cost and every pool has a free slot: no wait at all."""
    for cost, have in zip(costs, tokens, strict=True):
        if have < cost:
            return False
    for pool, count in zip(slots, held, strict=True):
        if count >= pool.size:
            return False
    return True


def _bucket_wait(bucket: Bucket, cost: int, tokens: float) -> float:
    if tokens >= cost:
        return 0.0
    if cost > bucket.capacity:
        return math.inf
    return (cost - tokens) / bucket.refill_per_s


def _first_positive(waits: list[float]) -> int:
    return next(index for index, wait in enumerate(waits) if wait > 0)


def _slot_wait(pool: SlotPool, held: int) -> float:
    if held < pool.size:
        return 0.0
    return math.inf if pool.size <= 0 else SLOT_RETRY_S
