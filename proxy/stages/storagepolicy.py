"""When shared storage fails: the tenant's open or closed policy, each decision counted."""

from __future__ import annotations

import logging
from collections import Counter

from proxy.clock import Clock, SystemClock
from proxy.errors import StorageUnavailable
from proxy.policy.model import Limits
from proxy.storage.base import StorageError

__all__ = ["StorageFailures"]

_log = logging.getLogger("tokenweir.storage")


class StorageFailures:
    """Counts each decision (`quota:open`, `rate_limit:closed`, ...) for /readyz and metrics."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.counts: Counter[str] = Counter()
        self.last_error: str | None = None
        self._clock = clock or SystemClock()
        self.last_failure_s: float | None = None  # monotonic; for `storage_unavailable` rules

    def failed_within(self, window_s: float) -> bool:
        """Did shared storage fail in the last `window_s` seconds?"""
        last = self.last_failure_s
        return last is not None and self._clock.monotonic() - last <= window_s

    def decide(self, what: str, limits: Limits, exc: StorageError) -> None:
        """Refuse with 503 if the tenant's policy is `closed`; else log and let the request in."""
        self.last_error = str(exc)
        self.last_failure_s = self._clock.monotonic()
        if limits.on_storage_error == "closed":
            self.counts[f"{what}:closed"] += 1
            raise StorageUnavailable(
                f"The {what.replace('_', ' ')} storage is unreachable; try again shortly.",
                retry_after_s=1,
            ) from exc
        self.counts[f"{what}:open"] += 1
        _log.warning("%s storage unreachable, admitting (on_storage_error: open): %s", what, exc)
