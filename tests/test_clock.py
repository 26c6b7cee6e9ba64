"""The fake clock's timers fire as time is advanced past them, each at its own time."""

from __future__ import annotations

from proxy.clock import FakeClock


def test_timers_fire_in_order_at_their_time_and_a_cancelled_one_never() -> None:
    clock = FakeClock(start_wall=100.0)
    fired: list[tuple[str, float, float]] = []

    def note(name: str) -> None:
        fired.append((name, clock.monotonic(), clock.wall()))

    clock.call_later(2.0, lambda: note("b"))
    clock.call_later(1.0, lambda: note("a"))
    clock.call_later(1.0, lambda: note("a2"))  # due with "a": after it, as set
    clock.call_later(1.5, lambda: note("never")).cancel()
    clock.advance(0.5)
    assert fired == []
    clock.advance(2.0)
    assert fired == [("a", 1.0, 101.0), ("a2", 1.0, 101.0), ("b", 2.0, 102.0)]
    assert (clock.monotonic(), clock.wall()) == (2.5, 102.5)


def test_a_timer_set_by_a_callback_fires_in_the_same_advance_when_due() -> None:
    clock = FakeClock()
    times: list[float] = []

    def every_second() -> None:
        times.append(clock.monotonic())
        clock.call_later(1.0, every_second)

    clock.call_later(1.0, every_second)
    clock.advance(3.5)
    assert times == [1.0, 2.0, 3.0]
