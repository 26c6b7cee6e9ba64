"""Long counts in worker threads: a few of one tenant's at a time, whatever it sends."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest

from proxy.policy import parse_policy
from proxy.tokens import TokenCounters
from proxy.tokens.base import Messages, Prompt, Tools
from proxy.tokens.lanes import LONG_COUNTS_PER_TENANT
from proxy.tokens.segments import counting_for, done_counting

pytestmark = pytest.mark.anyio
CHAT = [{"role": "user", "content": "a long prompt"}]


class HeldCounter:
    """A tokenizer whose counts run until `release`, recording who is counting."""

    name = "held"
    exact = True

    def __init__(self) -> None:
        self.release = threading.Event()
        self.counting: list[str] = []
        self._lock = threading.Lock()

    def count_text(self, text: str) -> int:
        return len(text)

    def count_chat(self, messages: Messages, tools: Tools = None) -> int:
        with self._lock:
            self.counting.append(str(messages[0]["content"]))
        self.release.wait(60)
        return 7

    def count_prompt(self, prompt: Prompt) -> int:
        return 1


def counters_over(counter: HeldCounter) -> TokenCounters:
    policy = parse_policy(
        """
backends: [{name: b, url: "http://127.0.0.1:9/v1", models: [m]}]
models: {m: {tokenizer: held}}
tenants: {}
""",
        environ={},
    )
    return TokenCounters(policy, inline_max_chars=0, loaded={"held": counter})


async def until(done: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # the counts run in threads: nothing to await on the loop
        if done():
            return
        await asyncio.sleep(0.01)


async def count_as(counters: TokenCounters, tenant: str) -> int:
    token = counting_for(tenant)
    try:
        return await counters.count_chat("m", [{"role": "user", "content": tenant}])
    finally:
        done_counting(token)


async def test_one_tenants_long_counts_take_a_few_threads_and_leave_the_rest() -> None:
    """Eight 4 MB prompts of one tenant took eight worker threads (of six on two cores: every
    one, for seconds each), and another tenant's long prompt waited behind them."""
    counter = HeldCounter()
    counters = counters_over(counter)
    flood = [asyncio.create_task(count_as(counters, "greedy")) for _ in range(8)]
    try:
        other = asyncio.create_task(count_as(counters, "other"))
        await until(lambda: "other" in counter.counting, 30)
        assert "other" in counter.counting, "the other tenant's count never started"
        await asyncio.sleep(0.2)  # what more of the flood the executor would start, it has
        assert counter.counting.count("greedy") == LONG_COUNTS_PER_TENANT
    finally:
        counter.release.set()
    assert await asyncio.wait_for(asyncio.gather(*flood, other), 60) == [7] * 9


async def test_a_client_that_leaves_does_not_free_its_place() -> None:
    """The thread goes on counting; the place is given back when it is done."""
    counter = HeldCounter()
    counters = counters_over(counter)
    first = [asyncio.create_task(count_as(counters, "greedy")) for _ in range(2)]
    await until(lambda: len(counter.counting) == 2, 30)
    for task in first:
        task.cancel()
    late = asyncio.create_task(count_as(counters, "greedy"))
    await asyncio.sleep(0.2)
    assert len(counter.counting) == 2  # the late count waits for a place
    counter.release.set()
    assert await asyncio.wait_for(late, 60) == 7
    assert len(counter.counting) == 3
