"""The request sent upstream is changed in one place: its model, and the bound on its answer's
length, which keeps the body's output fields, the output allowance and the shaping record in
step (shape, budget and degradation all bound the output through it)."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.apis import output_default, output_fields
from proxy.context import Operation
from proxy.outgoing import DEFAULT_OUTPUT_BOUND, OutgoingRequest


def outgoing(operation: Operation, **body: Any) -> OutgoingRequest:
    fields, default = output_fields(operation), output_default(operation)
    request = OutgoingRequest({"model": "m", **body}, "m", fields, default)
    request.allow_as_sent()
    return request


@pytest.mark.parametrize(
    ("operation", "body", "limit", "sent", "allowance", "shaped"),
    [
        ("chat", {"max_tokens": 900}, 500, {"max_tokens": 500}, 500, ["budget"]),
        ("chat", {"max_tokens": 300}, 500, {"max_tokens": 300}, 300, []),  # never raised
        ("chat", {}, 500, {"max_tokens": 500}, 500, ["budget"]),  # none set: chat's own
        # a backend may read either field: the allowance is the larger
        ("chat", {"max_completion_tokens": 900, "max_tokens": 400}, 500,
         {"max_completion_tokens": 500, "max_tokens": 400}, 500, ["budget"]),
        # max_tokens, which every chat backend reads, carries the bound too
        ("chat", {"max_completion_tokens": 900}, 500,
         {"max_completion_tokens": 500, "max_tokens": 500}, 500, ["budget"]),
        ("chat", {"max_completion_tokens": 300, "max_tokens": None}, 500,
         {"max_completion_tokens": 300, "max_tokens": 300}, 300, []),
        ("text_completion", {"max_tokens": None}, 16, {"max_tokens": 16}, 16, ["budget"]),
        # none set: the API's own default (16), where it is lower
        ("text_completion", {}, 500, {"max_tokens": 16}, 16, ["budget"]),
        ("text_completion", {}, 8, {"max_tokens": 8}, 8, ["budget"]),
        ("messages", {"max_tokens": 900}, 500, {"max_tokens": 500}, 500, ["budget"]),
        ("responses", {}, 64, {"max_output_tokens": 64}, 64, ["budget"]),
    ],
)  # fmt: skip
def test_the_answer_is_bounded_by_lowering_never_raising(
    operation: Operation,
    body: dict[str, Any],
    limit: int,
    sent: dict[str, int],
    allowance: int,
    shaped: list[str],
) -> None:
    request = outgoing(operation, **body)
    request.bound_output(limit, "budget")
    assert request.body == {"model": "m", **sent}
    assert request.allowance == allowance
    assert request.shaped == shaped


def test_the_reason_is_recorded_once_and_none_records_nothing() -> None:
    request = outgoing("chat", max_tokens=900)
    request.bound_output(800, "budget")
    request.bound_output(700, "budget")
    request.bound_output(600, None)  # a degradation rule records its own name
    assert (request.body["max_tokens"], request.allowance, request.shaped) == (600, 600, ["budget"])


def test_a_new_model_goes_into_the_body_too() -> None:
    request = outgoing("chat")
    request.set_model("small")
    assert (request.model, request.body["model"]) == ("small", "small")


def test_what_a_reservation_holds_is_a_bound_the_backend_is_sent() -> None:
    unbounded = outgoing("chat", n=3)
    unbounded.answers = 3
    # the quota and a key's own allowance both reserve: the first bounds, the second reads it
    assert unbounded.held_output() == unbounded.held_output() == 3 * DEFAULT_OUTPUT_BOUND
    assert unbounded.body["max_tokens"] == DEFAULT_OUTPUT_BOUND
    assert unbounded.shaped == ["max_tokens"]
    bounded = outgoing("text_completion", max_tokens=50)
    assert bounded.held_output() == 50
    assert bounded.body == {"model": "m", "max_tokens": 50}
    assert bounded.shaped == []


@pytest.mark.parametrize(
    ("budget", "limit", "sent"),
    [
        (2048, 1500, {"type": "enabled", "budget_tokens": 1499}),  # lowered under the bound
        (2048, 1024, None),  # under the least budget, 1,024: left out
        (1024, 1025, {"type": "enabled", "budget_tokens": 1024}),  # already under the bound
        (1400, 2000, {"type": "enabled", "budget_tokens": 1400}),  # the bound above max_tokens
    ],
)
def test_a_messages_bound_keeps_extended_thinking_below_it(
    budget: int, limit: int, sent: dict[str, object] | None
) -> None:
    """Anthropic refuses `thinking.budget_tokens` at or above `max_tokens`."""
    thinking = {"type": "enabled", "budget_tokens": budget}
    request = outgoing("messages", max_tokens=1600, thinking=thinking)
    request.bound_output(limit, "max_tokens")
    assert request.body["max_tokens"] == min(1600, limit)
    assert request.body.get("thinking") == sent
    assert thinking == {"type": "enabled", "budget_tokens": budget}  # the client's own, unchanged
