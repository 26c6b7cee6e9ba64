"""The mock backend's counters, served on GET /mock/stats: what tests and benchmarks check."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import orjson

from proxy.tools.mock.stream import Outcome

__all__ = ["MockStats"]


@dataclass(slots=True)
class MockStats:
    streams_started: int = 0
    streams_completed: int = 0
    streams_cancelled: int = 0
    streams_aborted: int = 0
    requests_total: int = 0
    models_listed: int = 0
    requests_cancelled: int = 0
    tokens_sent: int = 0
    inflight: int = 0
    prefix_hits: int = 0
    prefix_misses: int = 0
    last_request: Any = None
    last_authorization: str | None = None

    def reset(self) -> None:
        """Zero the counters; `inflight` keeps describing requests still running."""
        inflight = self.inflight
        for name, value in asdict(MockStats()).items():
            setattr(self, name, value)
        self.inflight = inflight

    def count_outcome(self, outcome: Outcome) -> None:
        if outcome is Outcome.COMPLETED:
            self.streams_completed += 1
        elif outcome is Outcome.CANCELLED:
            self.streams_cancelled += 1
        else:
            self.streams_aborted += 1

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))
