"""The request sent upstream is changed in one place: its model, and the bound on its answer's
length, which keeps the body's output fields, the output allowance and the shaping record in
step (shape, budget and degradation all bound the output through it)."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.context import Operation, RequestContext
from proxy.outgoing import bound_output, output_allowance, set_model
from proxy.upstream.meter import StreamMeter


def context(operation: Operation, **body: Any) -> RequestContext:
    ctx = RequestContext("r", operation, 0.0, 0.0, StreamMeter(0.0))
    ctx.body = {"model": "m", **body}
    ctx.model = "m"
    ctx.output_allowance = output_allowance(ctx)
    return ctx


@pytest.mark.parametrize(
    ("operation", "body", "limit", "sent", "allowance", "shaped"),
    [
        ("chat", {"max_tokens": 900}, 500, {"max_tokens": 500}, 500, ["budget"]),
        ("chat", {"max_tokens": 300}, 500, {"max_tokens": 300}, 300, []),  # never raised
        ("chat", {}, 500, {"max_tokens": 500}, 500, ["budget"]),  # none set: chat's own
        ("chat", {"max_completion_tokens": 900, "max_tokens": 400}, 500,
         {"max_completion_tokens": 500, "max_tokens": 400}, 400, ["budget"]),
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
    ctx = context(operation, **body)
    bound_output(ctx, limit, "budget")
    assert ctx.body == {"model": "m", **sent}
    assert ctx.output_allowance == allowance
    assert ctx.shaped == shaped


def test_the_reason_is_recorded_once_and_none_records_nothing() -> None:
    ctx = context("chat", max_tokens=900)
    bound_output(ctx, 800, "budget")
    bound_output(ctx, 700, "budget")
    bound_output(ctx, 600, None)  # a degradation rule records its own name
    assert (ctx.body["max_tokens"], ctx.output_allowance, ctx.shaped) == (600, 600, ["budget"])


def test_a_new_model_goes_into_the_body_too() -> None:
    ctx = context("chat")
    set_model(ctx, "small")
    assert (ctx.model, ctx.body["model"]) == ("small", "small")
