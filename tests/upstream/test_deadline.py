"""ReadDeadline: each deadline passes at its time, and an exchange that ends leaves no timer
behind. On a FakeClock: the loop's time and timers, moved by hand (the end-to-end timeouts are
in test_first_byte.py, test_limits.py and reliability/test_timeouts.py)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from proxy.clock import FakeClock, Timer
from proxy.upstream.deadline import Expiry, ReadDeadline


class ClockLoop:
    """What ReadDeadline uses of an event loop (`time`, `call_later`, `call_at`), on a
    FakeClock; keeps the timers neither fired nor cancelled."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.live: set[_Counted] = set()

    def time(self) -> float:
        return self.clock.monotonic()

    def call_later(
        self, delay_s: float, callback: Callable[..., object], *args: object
    ) -> _Counted:
        return self.call_at(self.time() + delay_s, callback, *args)

    def call_at(self, when: float, callback: Callable[..., object], *args: object) -> _Counted:
        counted = _Counted(self.live)
        counted.timer = self.clock.call_later(
            when - self.time(), partial(counted.fire, callback, *args)
        )
        self.live.add(counted)
        return counted


class _Counted:
    def __init__(self, live: set[_Counted]) -> None:
        self._live = live
        self.timer: Timer | None = None

    def fire(self, callback: Callable[..., object], *args: object) -> None:
        self._live.discard(self)
        callback(*args)

    def cancel(self) -> None:
        self._live.discard(self)
        if self.timer is not None:
            self.timer.cancel()


def deadline(
    loop: ClockLoop, idle_s: float | None, first_byte_s: float | None, total_s: float | None
) -> tuple[ReadDeadline, list[tuple[Expiry, float]]]:
    passed: list[tuple[Expiry, float]] = []
    made = ReadDeadline(
        loop,  # type: ignore[arg-type]
        idle_s,
        first_byte_s,
        lambda kind: passed.append((kind, loop.time())),
        total_s,
    )
    return made, passed


def test_an_exchange_answered_in_time_leaves_no_timer() -> None:
    loop = ClockLoop()
    read, passed = deadline(loop, 300.0, 300.0, 600.0)
    read.sent()
    loop.clock.advance(0.01)
    read.answered()
    read.waiting()
    loop.clock.advance(0.01)
    read.cancel()
    assert (len(loop.live), passed) == (0, [])


def test_the_first_byte_deadline_counts_from_the_sending() -> None:
    loop = ClockLoop()
    read, passed = deadline(loop, None, 1.0, 10.0)
    loop.clock.advance(0.5)
    read.sent()
    loop.clock.advance(0.9)  # one second after the exchange began, not after the sending
    assert passed == []
    loop.clock.advance(1.0)
    assert passed == [("first_byte", 1.5)]


def test_after_the_first_byte_each_wait_has_the_idle_limit_and_no_first_byte_one() -> None:
    loop = ClockLoop()
    read, passed = deadline(loop, 2.0, 1.0, 100.0)
    read.sent()
    loop.clock.advance(0.5)
    read.answered()
    read.waiting()
    loop.clock.advance(1.9)
    assert passed == []
    read.waiting()  # data came and a new wait began at 2.4: its deadline is 4.4
    loop.clock.advance(3.0)
    assert passed == [("idle", 4.4)]


def test_the_total_deadline_holds_when_an_idle_one_passing_begins_another_wait() -> None:
    """The idle deadline passes at 5 with nobody reading: the exchange's next wait (deadline
    10) begins in the callback, and the total deadline still passes at 7, ending the exchange
    (as its failing does)."""
    loop = ClockLoop()
    passed: list[tuple[Expiry, float]] = []

    def expired(kind: Expiry) -> None:
        passed.append((kind, loop.time()))
        if kind == "idle":
            read.waiting()
        else:
            read.cancel()

    read = ReadDeadline(loop, 5.0, None, expired, 7.0)  # type: ignore[arg-type]
    read.waiting()
    loop.clock.advance(20.0)
    assert passed == [("idle", 5.0), ("total", 7.0)]


def test_a_cancelled_exchange_leaves_no_timer_and_nothing_passes() -> None:
    loop = ClockLoop()
    read, passed = deadline(loop, 1.0, 1.0, 2.0)
    read.sent()
    read.cancel()
    loop.clock.advance(10.0)
    assert (len(loop.live), passed) == (0, [])
