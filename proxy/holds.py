"""What a request holds while it runs, as its context carries it: the quota reservation (budget
stage), the rate-limit hold (rate-limit stage), the backend it is routed to (route stage) and the
admission plans prefetched for it. They live here, below the stages that make them, so that the
context imports no stage.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from proxy.leases import Lease
from proxy.routing.health import BackendHealth
from proxy.storage.base import Counter
from proxy.storage.limits import Bucket, SlotPool
from proxy.upstream.exchange import STALE_RESEND

__all__ = ["Planned", "Quota", "RateLimitHold", "Reservation", "Routed"]

P = TypeVar("P")


@dataclass(frozen=True, slots=True)
class Quota:
    name: str  # the policy key, e.g. "tokens_per_day"
    in_usd: bool
    counter: Counter


@dataclass(slots=True)
class Reservation(Lease):
    quotas: tuple[Quota, ...]
    # Per quota, the usage so far the checkpoints sent (stages/checkpoint.py): the store books
    # from its lease's own record, and from this only once it no longer holds the lease.
    charged: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.charged = [0] * len(self.quotas)


@dataclass(slots=True)
class RateLimitHold(Lease):
    """What an admitted request holds until it is settled: its slots' lease, what it was
    charged on token buckets, and the request buckets it took one from."""

    slots: tuple[SlotPool, ...]
    token_buckets: tuple[tuple[Bucket, int], ...] = ()
    request_buckets: tuple[Bucket, ...] = ()

    def part_on(self, model: str) -> RateLimitHold:
        """Its limits on `model` (a tenant's `per_model`), taken out of it as a hold of their
        own under the same lease; what stays is renewed and settled as before."""

        def on(limit: Bucket | SlotPool) -> bool:
            return limit.name is not None and limit.name.model == model

        part = RateLimitHold(self.scope, self.lease_id, self.lease_s, ())
        part.slots = tuple(pool for pool in self.slots if on(pool))
        part.token_buckets = tuple(held for held in self.token_buckets if on(held[0]))
        part.request_buckets = tuple(bucket for bucket in self.request_buckets if on(bucket))
        self.slots = tuple(pool for pool in self.slots if not on(pool))
        self.token_buckets = tuple(held for held in self.token_buckets if not on(held[0]))
        self.request_buckets = tuple(b for b in self.request_buckets if not on(b))
        if not self.slots:
            self.end()  # no slot left to renew
        return part


@dataclass(slots=True)
class Routed:
    """The backend a request holds in flight, and what it has tried."""

    home: str  # the model asked for (after degradation): its fallbacks are the ones tried
    health: BackendHealth
    tried: list[str] = field(default_factory=list)
    passed: int = 0  # of `tried`, those passed over as full: no attempt was made on them
    attempt_s: float = 0.0
    sent: bool = False  # the current attempt's request reached its backend whole
    opened: bool = False
    counted: bool = False  # in the backend's count across replicas (BackendHealth.counted)

    def answering(self) -> None:
        """The backend's stream began well (its first event): see Circuit.answering."""
        self.health.circuit.answering()

    async def trace(self, event: str, info: dict[str, Any]) -> None:
        """httpcore's `trace` request extension, which the pooled transport calls too: the
        request went out whole (a client that leaves now is billed the backend's work), or,
        written to a keep-alive connection the backend had closed, did not reach it after all
        and is sent again on a new one (not sent until then)."""
        if event.endswith("send_request_body.complete"):
            self.sent = True
        elif event == STALE_RESEND:
            self.sent = False


class Planned:
    """Each stage's plan, by its type, until the stage takes it (once: a second run of a stage,
    as degradation's second cache lookup, plans and calls on its own)."""

    __slots__ = ("_plans",)

    def __init__(self, plans: Iterable[object]) -> None:
        self._plans = {type(plan): plan for plan in plans}

    def take(self, kind: type[P]) -> P | None:
        plan = self._plans.pop(kind, None)
        return plan if isinstance(plan, kind) else None
