"""The circuit breaker: failures in a row open it, a trial closes it, back-off doubles."""

from __future__ import annotations

from proxy.clock import FakeClock
from proxy.policy.model import CircuitSpec
from proxy.routing.circuit import Circuit


def test_opens_after_failures_in_a_row_and_closes_after_a_good_trial() -> None:
    clock = FakeClock()
    circuit = Circuit(CircuitSpec(failures=2, open_for=1.0, max_open_for=10.0))
    circuit.failed(clock.monotonic())
    assert circuit.available(clock.monotonic())
    circuit.failed(clock.monotonic())
    assert not circuit.available(clock.monotonic())
    clock.advance(1.0)
    assert circuit.available(clock.monotonic())
    circuit.picked(clock.monotonic())
    assert not circuit.available(clock.monotonic()), "one trial at a time"
    circuit.succeeded()
    assert circuit.available(clock.monotonic())
    assert not circuit.is_open


def test_a_failed_trial_doubles_the_back_off_up_to_the_maximum() -> None:
    clock = FakeClock()
    circuit = Circuit(CircuitSpec(failures=1, open_for=1.0, max_open_for=3.0))
    circuit.failed(clock.monotonic())
    waits = []
    for _ in range(3):
        opened_at = clock.monotonic()
        while not circuit.available(clock.monotonic()):
            clock.advance(0.5)
        waits.append(clock.monotonic() - opened_at)
        circuit.picked(clock.monotonic())
        circuit.failed(clock.monotonic())
    assert waits == [1.0, 2.0, 3.0]


def test_a_success_between_failures_resets_the_count() -> None:
    circuit = Circuit(CircuitSpec(failures=2))
    circuit.failed(0.0)
    circuit.succeeded()
    circuit.failed(0.0)
    assert circuit.available(0.0)


def test_an_abandoned_trial_may_be_tried_again() -> None:
    circuit = Circuit(CircuitSpec(failures=1, open_for=1.0))
    circuit.failed(0.0)
    circuit.picked(1.0)
    assert not circuit.available(1.0)
    circuit.abandoned()
    assert circuit.available(1.0)


def test_an_answer_begun_ends_the_trial_and_failures_count_on() -> None:
    """A trial stream's first event closes the circuit; a stream that then breaks opens it
    again at once, as the failures in a row were not reset by the answer's start."""
    circuit = Circuit(CircuitSpec(failures=2, open_for=1.0))
    circuit.failed(0.0)
    circuit.failed(0.0)
    circuit.picked(1.0)
    circuit.answering()
    assert circuit.available(1.0)
    assert not circuit.is_open
    circuit.failed(1.5)
    assert not circuit.available(1.5)
