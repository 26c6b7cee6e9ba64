"""What the gateway knows about one backend: circuit, probe result, requests in flight, and
rolling TTFT, tokens/s and outcomes over the last minute."""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING

from proxy.policy.model import Backend, CircuitSpec
from proxy.routing.circuit import Circuit

if TYPE_CHECKING:
    from proxy.upstream.meter import StreamMeter

__all__ = ["SHARED_COUNT_S", "WINDOW_S", "BackendHealth", "Window"]

WINDOW_S = 60.0
# How long a backend's count across replicas (its slot pool's, at this process's last admission
# there) is believed; after it, only this process's own requests are known.
SHARED_COUNT_S = 1.0
_MAX_SAMPLES = 256


class Window:
    """The last samples (at most `_MAX_SAMPLES`, none older than `WINDOW_S`) of one signal."""

    __slots__ = ("_samples",)

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=_MAX_SAMPLES)

    def add(self, now_s: float, value: float) -> None:
        self._samples.append((now_s, value))

    def recent(self, now_s: float) -> list[float]:
        samples = self._samples
        while samples and samples[0][0] < now_s - WINDOW_S:
            samples.popleft()
        return [value for _, value in samples]


def quantile(values: list[float], q: float) -> float | None:
    """The nearest-rank quantile `q` of `values`, None if there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class BackendHealth:
    """One per backend, shared by every model it serves; the route stage keeps it current."""

    __slots__ = (
        "_shared",
        "_shared_s",
        "active",
        "backend",
        "circuit",
        "limited_until_s",
        "outcomes",
        "probe_error",
        "tokens_per_s",
        "ttft",
    )

    def __init__(self, backend: Backend, spec: CircuitSpec) -> None:
        self.backend = backend
        self.circuit = Circuit(spec)
        self.probe_error: str | None = None  # what the last active probe found wrong
        self.active: set[StreamMeter] = set()  # requests in flight on this backend, by meter
        self.ttft = Window()
        self.tokens_per_s = Window()
        self.outcomes = Window()  # 1.0 for a failure, 0.0 for a success
        # Until when the backend asked, with a 429's Retry-After, to be sent no more: it is
        # then its pool's last choice (its requests go to another backend while one is left).
        self.limited_until_s = -math.inf
        self._shared = 0  # requests in flight across replicas, as last counted (see `counted`)
        self._shared_s = -math.inf

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def inflight(self) -> int:
        """This process's requests in flight on the backend."""
        return len(self.active)

    def counted(self, inflight: int, now_s: float) -> None:
        """The backend's requests in flight across every replica sharing its limits, as its
        `max_concurrent` pool counted them when this process was admitted there."""
        self._shared, self._shared_s = inflight, now_s

    def left(self, meter: StreamMeter, counted: bool) -> None:
        """A request of this process no longer holds the backend; `counted`: the count across
        replicas held it (it was admitted at or before that count), so it is one lower too."""
        self.active.discard(meter)
        if counted:
            self._shared -= 1

    def count_is_stale(self, now_s: float) -> bool:
        """The count across replicas is no longer believed (see `inflight_at`)."""
        return now_s - self._shared_s > SHARED_COUNT_S

    def inflight_at(self, now_s: float) -> int:
        """Requests in flight on the backend as this process best knows: the count across
        replicas while fresh (`SHARED_COUNT_S`), never below its own."""
        own = len(self.active)
        if self.count_is_stale(now_s):
            return own
        return max(own, self._shared)

    def available(self, now_s: float) -> bool:
        return self.probe_error is None and self.circuit.available(now_s)

    def waiting(self) -> int:
        """Requests in flight that have had no token yet: queued or prefilling at the backend."""
        return sum(1 for meter in self.active if meter.first_token_s is None)

    def failed(self, now_s: float) -> None:
        self.circuit.failed(now_s)
        self.outcomes.add(now_s, 1.0)

    def limited(self, now_s: float, wait_s: float | None) -> None:
        """The backend answered 429: it is healthy but full for `wait_s` (its Retry-After, 1 s
        without one). No failure: its circuit stays as it was, a trial left untried."""
        self.circuit.abandoned()
        self.limited_until_s = max(self.limited_until_s, now_s + (wait_s or 1.0))

    def served(self, now_s: float, ttft_s: float | None, tokens_per_s: float | None) -> None:
        self.outcomes.add(now_s, 0.0)
        if ttft_s is not None:
            self.ttft.add(now_s, ttft_s)
        if tokens_per_s is not None:
            self.tokens_per_s.add(now_s, tokens_per_s)
