"""The fake clock's timers fire as time is advanced past them, each at its own time."""

from __future__ import annotations

import asyncio
import threading

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


def test_a_timer_set_on_a_loop_fires_on_that_loop_when_another_thread_advances() -> None:
    """A gateway served in a thread of its own, its fake clock advanced by the test's thread:
    the timer's callback runs in the server's loop, as a real timer's would."""
    clock = FakeClock()
    ran_in: list[threading.Thread] = []
    fired = threading.Event()
    set_up = threading.Event()

    def serve() -> None:
        async def main() -> None:
            def note() -> None:
                ran_in.append(threading.current_thread())
                fired.set()

            clock.call_later(1.0, note)
            set_up.set()
            await asyncio.to_thread(fired.wait, 30)  # a limit, not a measurement

        asyncio.run(main())

    server = threading.Thread(target=serve)
    server.start()
    assert set_up.wait(30)
    clock.advance(1.0)
    server.join(30)
    assert ran_in == [server]


def test_a_wall_step_moves_neither_the_monotonic_clock_nor_its_timers() -> None:
    clock = FakeClock(start_wall=100.0)
    fired: list[float] = []
    clock.call_later(1.0, lambda: fired.append(clock.wall()))
    clock.step_wall(-50.0)
    assert (clock.monotonic(), clock.wall(), fired) == (0.0, 50.0, [])
    clock.advance(1.0)
    assert fired == [51.0]
