"""The cache stage's settle: a miss's answer is stored under its key only if it answers the
request as that key was looked up (the prefetch's lookup, then a later stage's second one)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from proxy.context import Admitted
from proxy.policy.model import Budget, Limits
from tests.stages.test_prefetch import Counting, Gateway, request

pytestmark = pytest.mark.anyio

USAGE: dict[str, Any] = {"prompt_tokens": 100, "completion_tokens": 2, "total_tokens": 102}
ANSWER: dict[str, Any] = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "m",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "Hi."}, "finish_reason": "stop"}
    ],
    "usage": USAGE,
}


def answered(ctx: Admitted) -> None:
    """The backend answered the request whole, and the client had all of it."""
    ctx.outcome.status = 200
    ctx.outcome.completed = True
    ctx.outcome.parsed = ANSWER
    ctx.outcome.usage = USAGE
    assert ctx.capture is not None
    ctx.capture.add(b"{}")


def unchanged(ctx: Admitted) -> None:
    return None


def to_another_model(ctx: Admitted) -> None:
    ctx.outgoing.set_model("small")


def shortened(ctx: Admitted) -> None:
    ctx.outgoing.bound_output(3, None)


@pytest.mark.parametrize(
    ("change", "kept"), [(unchanged, True), (to_another_model, False), (shortened, False)]
)
async def test_a_second_lookup_after_the_request_changed_keeps_its_answer_from_the_first_key(
    change: Callable[[Admitted], None], kept: bool
) -> None:
    """A stage that changes the request (another model, a shorter bound) and then looks in the
    cache again: the second lookup took the changed request as the one asked for, while the
    entry kept the first lookup's key, so the changed answer was stored for the request as
    the client sent it (a 3-token answer served as a plain hit once the load had gone)."""
    gateway = Gateway(Counting())
    ctx = request(Budget(), Limits())
    await gateway(ctx)
    assert ctx.cache == "miss"
    change(ctx)
    ctx.cache_serve_stale = True  # a degradation rule's second lookup
    await gateway.cache(ctx)
    answered(ctx)
    await gateway.cache.settle(ctx)
    again = request(Budget(), Limits())
    await gateway(again)
    assert again.cache == ("hit" if kept else "miss")
