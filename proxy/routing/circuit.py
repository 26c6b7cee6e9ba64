"""A backend's circuit breaker: failures in a row open it, a timed trial request may close it."""

from __future__ import annotations

from proxy.policy.model import CircuitSpec

__all__ = ["Circuit"]


class Circuit:
    """Closed (serving), open (skipped until `open_until_s`), then one trial at a time.

    A failed trial reopens the circuit for twice as long, up to the spec's maximum; a success
    closes it and resets the back-off.
    """

    __slots__ = ("_backoff_s", "_failures", "_spec", "_trial", "open_until_s")

    def __init__(self, spec: CircuitSpec) -> None:
        self._spec = spec
        self._failures = 0
        self._backoff_s = spec.open_for
        self._trial = False
        self.open_until_s: float | None = None

    @property
    def is_open(self) -> bool:
        return self.open_until_s is not None

    def available(self, now_s: float) -> bool:
        """May a request go to this backend now (closed, or open but due for its one trial)?"""
        if self.open_until_s is None:
            return True
        return now_s >= self.open_until_s and not self._trial

    def picked(self, now_s: float) -> None:
        """A request goes to this backend; if the circuit is open, it is the trial."""
        if self.open_until_s is not None and now_s >= self.open_until_s:
            self._trial = True

    def abandoned(self) -> None:
        """The picked request never reached the backend: a trial may be tried again."""
        self._trial = False

    def answering(self) -> None:
        """The picked request's answer began well (a whole answer's head, a stream's first
        event): a trial has its verdict and the circuit closes; failures in a row are counted
        on to the answer's end (`succeeded`, or `failed` if it breaks off)."""
        self._trial = False
        self.open_until_s = None

    def succeeded(self) -> None:
        self._failures = 0
        self._trial = False
        self._backoff_s = self._spec.open_for
        self.open_until_s = None

    def failed(self, now_s: float) -> None:
        self._failures += 1
        if not self._trial and self._failures < self._spec.failures:
            return
        if self._trial:
            self._backoff_s = min(self._backoff_s * 2.0, self._spec.max_open_for)
        self._trial = False
        self.open_until_s = now_s + self._backoff_s
