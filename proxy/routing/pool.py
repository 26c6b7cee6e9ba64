"""The backend pools: one health record per backend, one pool per model with its strategy."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from proxy.clock import Clock
from proxy.policy.model import ModelSpec, Policy
from proxy.routing.health import BackendHealth, quantile
from proxy.routing.strategies import Strategy, strategy_for

__all__ = ["MIN_OUTCOMES", "ModelPool", "PoolSignals", "Pools"]

MIN_OUTCOMES = 5  # an error rate over fewer requests than this is noise, not a signal


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """A model's load and health now, for degradation rules (None: nothing to go on)."""

    inflight_ratio: float | None  # in flight / the backends' max_concurrent
    queue_depth: int  # in flight with no token yet
    ttft_p95_s: float | None
    error_rate: float | None


class ModelPool:
    __slots__ = ("capacity", "members", "name", "spec", "strategy")

    def __init__(
        self, name: str, spec: ModelSpec, members: tuple[BackendHealth, ...], strategy: Strategy
    ) -> None:
        self.name = name
        self.spec = spec
        self.members = members
        self.strategy = strategy
        # The backends' `max_concurrent` together (0: none has one, and no ratio is known).
        self.capacity = sum(h.backend.limits.max_concurrent or 0 for h in members)

    def available(self, now_s: float) -> list[BackendHealth]:
        return [h for h in self.members if h.available(now_s)]

    def inflight_ratio(self, now_s: float) -> float | None:
        """Requests in flight over the `max_concurrent` of the backends that can take one (a
        backend that is down serves none of it: with one of two down, the other full read as
        half full), across replicas as far as this process knows (BackendHealth.inflight_at)."""
        if not self.capacity:
            return None
        capacity = inflight = 0
        for health in self.members:
            limit = health.backend.limits.max_concurrent
            if limit and health.available(now_s):
                capacity += limit
                inflight += health.inflight_at(now_s)
        return inflight / capacity if capacity else None

    def signals(self, now_s: float) -> PoolSignals:
        ttfts = [v for h in self.members for v in h.ttft.recent(now_s)]
        outcomes = [v for h in self.members for v in h.outcomes.recent(now_s)]
        return PoolSignals(
            inflight_ratio=self.inflight_ratio(now_s),
            queue_depth=sum(h.waiting() for h in self.members),
            ttft_p95_s=quantile(ttfts, 0.95),
            error_rate=sum(outcomes) / len(outcomes) if len(outcomes) >= MIN_OUTCOMES else None,
        )


class Pools:
    """Built once per process from the policy; the route stage and the prober update it."""

    def __init__(
        self, policy: Policy, clock: Clock, kept: Mapping[str, BackendHealth] | None = None
    ) -> None:
        """`kept`: the health of the backends of the policy before a reload; a backend the
        reload leaves as it was keeps its own (its probe's finding, its circuit, its requests
        in flight), so a backend found dead stays out of rotation."""
        self.clock = clock
        kept = kept or {}
        self.health = {}
        for backend in policy.backends:
            health = kept.get(backend.name)
            if health is None or health.backend != backend:
                health = BackendHealth(backend, policy.upstream.circuit)
            self.health[backend.name] = health
        self._pools: dict[str, ModelPool] = {}
        for name, spec in policy.models.items():
            backends = policy.backends_for(name)
            members = tuple(self.health[b.name] for b in backends)
            strategy = strategy_for(spec.routing, backends, spec.affinity_load_factor)
            self._pools[name] = ModelPool(name, spec, members, strategy)

    def pool(self, model: str) -> ModelPool:
        return self._pools[model]

    def chain(self, model: str) -> Iterator[ModelPool]:
        """The model's pool, then its fallback models' pools in order."""
        pool = self._pools[model]
        yield pool
        for fallback in pool.spec.fallback_models:
            yield self._pools[fallback]

    def retry_after_s(self, model: str) -> float:
        """When a backend of the model (or a fallback) may be tried again, at least 1 s away."""
        now = self.clock.monotonic()
        reopen = [
            h.circuit.open_until_s - now
            for pool in self.chain(model)
            for h in pool.members
            if h.probe_error is None and h.circuit.open_until_s is not None
        ]
        return max(1.0, min(reopen, default=1.0))
