"""Shaping to the budget card: each rule with its edge cases, with a word-counting stand-in.

The stand-in counts one token per word plus 4 per message, so expected counts can be read off
the test data; the real tokenizers are tested in tests/tokens/ and end to end.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from proxy.clock import FakeClock
from proxy.context import Admitted, Operation
from proxy.errors import ContextLengthExceeded
from proxy.policy.model import Budget, Tenant
from proxy.policy.units import hash_key
from proxy.stages.shape import Shape
from tests.contexts import admitted


class WordCounter:
    def __init__(self) -> None:
        self.calls = 0

    async def count_chat(
        self, model: str, messages: Sequence[Mapping[str, Any]], tools: Any = None
    ) -> int:
        self.calls += 1
        return sum(4 + len(str(m.get("content", "")).split()) for m in messages)

    async def count_prompt(self, model: str, prompt: Any) -> int:
        return len(str(prompt).split())


def context(budget: Budget, body: dict[str, Any], operation: Operation = "chat") -> Admitted:
    tenant = Tenant(api_keys=(hash_key("k"),), models=("m",), budget=budget)
    return admitted(tenant, body, operation=operation, received_wall=FakeClock().wall())


def chat(*pairs: tuple[str, str], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": r, "content": c} for r, c in pairs], **extra}


pytestmark = pytest.mark.anyio


async def test_untouched_request_is_counted_once_and_not_shaped() -> None:
    counter = WordCounter()
    ctx = context(Budget(tokens_per_day=1000), chat(("user", "one two three")))
    await Shape(counter)(ctx)
    assert ctx.outgoing.shaped == []
    assert ctx.counted_input_tokens == 7
    assert counter.calls == 1
    assert ctx.outgoing.allowance is None


async def test_nothing_is_counted_when_no_limit_needs_the_count() -> None:
    counter = WordCounter()
    ctx = context(Budget(system_prompt="s", max_output_tokens=5), chat(("user", "a b")))
    await Shape(counter)(ctx)
    assert counter.calls == 0
    assert ctx.counted_input_tokens is None
    assert ctx.outgoing.shaped == ["system_prompt", "max_tokens"]


async def test_system_prompt_is_enforced_first_and_not_doubled() -> None:
    budget = Budget(system_prompt="你是智能客服助手")
    ctx = context(budget, chat(("system", "be a pirate"), ("user", "hi")))
    await Shape(WordCounter())(ctx)
    assert [m["content"] for m in ctx.body["messages"]] == ["你是智能客服助手", "be a pirate", "hi"]
    assert ctx.outgoing.shaped == ["system_prompt"]
    again = context(budget, chat(("system", "你是智能客服助手"), ("user", "hi")))
    await Shape(WordCounter())(again)
    assert again.outgoing.shaped == []


async def test_history_limit_keeps_system_and_last_turns_from_a_user_message() -> None:
    turns = [("system", "s"), ("user", "u1"), ("assistant", "a1"), ("user", "u2"),
             ("assistant", "a2"), ("user", "u3")]  # fmt: skip
    ctx = context(Budget(history_limit=2), chat(*turns))
    await Shape(WordCounter())(ctx)
    # The last two are a2, u3; a reply without its question is dropped too.
    assert [m["content"] for m in ctx.body["messages"]] == ["s", "u3"]
    ctx = context(Budget(history_limit=3), chat(*turns))
    await Shape(WordCounter())(ctx)
    assert [m["content"] for m in ctx.body["messages"]] == ["s", "u2", "a2", "u3"]
    assert ctx.outgoing.shaped == ["history"]


def agent_loop(rounds: int) -> dict[str, Any]:
    """A user's question, then `rounds` of an assistant's two parallel tool calls and results."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "s"}]
    messages.append({"role": "user", "content": "w " * 10})
    for r in range(rounds):
        ids = [f"call_{r}a", f"call_{r}b"]
        calls = [{"id": i, "type": "function", "function": {"name": "f"}} for i in ids]
        messages.append({"role": "assistant", "content": None, "tool_calls": calls})
        messages += [{"role": "tool", "tool_call_id": i, "content": "w " * 5} for i in ids]
    return {"model": "m", "messages": messages}


async def test_history_limit_never_sends_a_tool_result_without_its_call() -> None:
    """An agent's tool rounds after the question: the window starts at an assistant's calls,
    and a window of results alone reaches back to the calls they answer (was: the newest
    result alone, which OpenAI refuses with a 400)."""
    for limit, roles in [
        (1, ["system", "assistant", "tool", "tool"]),
        (3, ["system", "assistant", "tool", "tool"]),
        (4, ["system", "assistant", "tool", "tool"]),
        (6, ["system", "assistant", "tool", "tool", "assistant", "tool", "tool"]),
        (7, ["system", "user", "assistant", "tool", "tool", "assistant", "tool", "tool"]),
    ]:
        ctx = context(Budget(history_limit=limit), agent_loop(2))
        await Shape(WordCounter())(ctx)
        assert [m["role"] for m in ctx.body["messages"]] == roles, limit


async def test_max_input_tokens_trims_an_agent_loop_at_its_tool_rounds() -> None:
    """Over the limit, an agent's oldest rounds go, each call with its results; a newest round
    that cannot fit is refused, never cut from its call (was: the newest result alone)."""
    # system 5, user 14, each round 5 (a null content is a word here) + 9 + 9 = 23
    ctx = context(Budget(max_input_tokens=52), agent_loop(3))
    await Shape(WordCounter())(ctx)
    roles = [m["role"] for m in ctx.body["messages"]]
    assert roles == ["system", "assistant", "tool", "tool", "assistant", "tool", "tool"]
    assert ctx.counted_input_tokens == 51
    with pytest.raises(ContextLengthExceeded):
        await Shape(WordCounter())(context(Budget(max_input_tokens=20), agent_loop(3)))


async def test_max_input_tokens_drops_oldest_turns_until_it_fits() -> None:
    words = "w " * 10
    body = chat(("system", "s"), ("user", words), ("assistant", words), ("user", words),
                ("assistant", words), ("user", "last question"))  # fmt: skip
    ctx = context(Budget(max_input_tokens=40), body)
    await Shape(WordCounter())(ctx)
    # system 5 + user 14 + assistant 14 + last 6 = 39 <= 40
    assert [m["role"] for m in ctx.body["messages"]] == ["system", "user", "assistant", "user"]
    assert ctx.counted_input_tokens == 39
    assert ctx.outgoing.shaped == ["input"]


async def test_newest_message_alone_too_long_is_context_length_exceeded() -> None:
    body = chat(("user", "short"), ("user", "w " * 50))
    with pytest.raises(ContextLengthExceeded) as caught:
        await Shape(WordCounter())(context(Budget(max_input_tokens=20), body))
    assert caught.value.status == 400
    assert caught.value.code == "context_length_exceeded"
    assert "54 tokens" in caught.value.message


async def test_on_input_overflow_reject_refuses_instead_of_trimming() -> None:
    body = chat(("user", "w " * 10), ("user", "ok"))
    budget = Budget(max_input_tokens=15, on_input_overflow="reject")
    with pytest.raises(ContextLengthExceeded):
        await Shape(WordCounter())(context(budget, body))


async def test_max_output_tokens_clamps_or_sets() -> None:
    budget = Budget(max_output_tokens=128)
    ctx = context(budget, chat(("user", "hi"), max_tokens=1000, max_completion_tokens=64))
    await Shape(WordCounter())(ctx)
    assert (ctx.body["max_tokens"], ctx.body["max_completion_tokens"]) == (128, 64)
    assert ctx.outgoing.allowance == 128  # Ollama reads max_tokens: the larger may be generated
    assert ctx.outgoing.shaped == ["max_tokens"]
    unset = context(budget, chat(("user", "hi")))
    await Shape(WordCounter())(unset)
    assert unset.body["max_tokens"] == 128
    assert unset.outgoing.allowance == 128
    within = context(budget, chat(("user", "hi"), max_tokens=100))
    await Shape(WordCounter())(within)
    assert within.outgoing.shaped == []


@pytest.mark.parametrize(
    ("budget", "sent", "expected", "shaped"),
    [
        (Budget(temperature=0.3), None, 0.3, True),
        (Budget(temperature=0.3), 0.9, 0.3, True),
        (Budget(temperature=0.3), 0.3, 0.3, False),
        (Budget(temperature_max=0.5), 0.9, 0.5, True),
        (Budget(temperature_max=0.5), 0.2, 0.2, False),
        (Budget(temperature_max=0.5), None, 0.5, True),
        (Budget(temperature_max=1.5), None, None, False),
    ],
)
async def test_temperature(
    budget: Budget, sent: float | None, expected: float | None, shaped: bool
) -> None:
    extra = {} if sent is None else {"temperature": sent}
    ctx = context(budget, chat(("user", "hi"), **extra))
    await Shape(WordCounter())(ctx)
    assert ctx.body.get("temperature") == expected
    assert ("temperature" in ctx.outgoing.shaped) is shaped


async def test_completions_and_embeddings_are_counted_and_limited() -> None:
    ctx = context(Budget(max_input_tokens=3), {"model": "m", "prompt": "a b"}, "text_completion")
    await Shape(WordCounter())(ctx)
    assert ctx.counted_input_tokens == 2
    ctx = context(Budget(), {"model": "m", "prompt": "a b"}, "text_completion")
    await Shape(WordCounter())(ctx)
    assert ctx.counted_input_tokens is None
    ctx = context(Budget(max_input_tokens=3), {"model": "m", "prompt": "a b"}, "text_completion")
    await Shape(WordCounter())(ctx)
    assert ctx.counted_input_tokens == 2
    with pytest.raises(ContextLengthExceeded):
        await Shape(WordCounter())(
            context(Budget(max_input_tokens=3), {"model": "m", "input": "a b c d"}, "embeddings")
        )


async def test_trimming_leaves_room_for_what_the_template_adds() -> None:
    # `documents` (5 words and 2 keys) count beside the messages: the history is trimmed to fit
    # beside them
    words = "w " * 10
    body = chat(("user", words), ("assistant", words), ("user", "last question"))
    body["documents"] = [{"title": "a", "text": "b c d e"}]
    ctx = context(Budget(max_input_tokens=30), body)
    await Shape(WordCounter())(ctx)
    assert [m["content"] for m in ctx.body["messages"]] == ["last question"]
    assert ctx.counted_input_tokens == 7 + 6
    big = chat(("user", "short"))
    big["documents"] = [{"text": "w " * 40}]
    with pytest.raises(ContextLengthExceeded, match="46 tokens"):
        await Shape(WordCounter())(context(Budget(max_input_tokens=30), big))
