"""The mock backend's tool calls on the Responses and Messages APIs, each in its own shapes
(the calls themselves, their arguments and pieces, come from toolcalls.py as on chat).

Responses: function `tools` are flat (`name`, `parameters`); `tool_choice` is "none", "auto"
(the default: a call when the newest input item is the user's, not a `function_call_output`),
"required" or {"type": "function", "name": ...}; `parallel_tool_calls: false` forbids
`mock_tool_calls` > 1. The answer's `output` holds `function_call` items (id "fc_...",
`call_id`, `name`, `arguments`, `status`). Messages: `tools` have `name` and `input_schema`
(a hosted tool, one with a `type`, is never called); `tool_choice` is {"type": "auto"} (the
default: a call when the last message is the user's and holds no `tool_result`), "any", "tool"
with a `name`, or "none"; `disable_parallel_tool_use` forbids parallel calls. The content holds
`tool_use` blocks (id "toolu_...", `name`, `input` as an object), stop_reason "tool_use".

A call cut by the output cap keeps its partial arguments in a Responses item (status
"incomplete"); a cut `tool_use` block's `input` holds the properties whose values arrived whole.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Final

import orjson

from proxy.tools.mock.request import MockHTTPError
from proxy.tools.mock.toolcalls import call_count, chosen_tool, function_tools, make_plan
from proxy.tools.mock.toolplan import ToolPlan, call_id

__all__ = ["AgentCalls", "messages_tool_plan", "responses_tool_plan"]

_MESSAGES_CHOICE: Final = (
    'tool_choice: must be {"type": "auto"}, {"type": "any"}, {"type": "none"} '
    'or {"type": "tool", "name": ...}'
)
_MESSAGES_CHOICES: Final = {"auto": "auto", "any": "required", "none": "none"}  # OpenAI's words


def responses_tool_plan(body: dict[str, Any], prompt_text: str) -> ToolPlan | None:
    """The calls a Responses request is answered with, None for a text answer."""
    calls = call_count(body)
    functions = function_tools(body.get("tools"), _responses_function, "parameters")
    if not functions:
        return None
    given = body["input"]  # a string (the user's question) or a checked list of objects
    newest = given[-1] if isinstance(given, list) else {"role": "user"}
    asked = newest.get("type", "message") == "message" and newest.get("role") == "user"
    chosen = chosen_tool(body.get("tool_choice"), functions, asked, _responses_choice)
    serial = "'parallel_tool_calls' is false" if body.get("parallel_tool_calls") is False else ""
    return make_plan(functions, chosen, calls, prompt_text, serial=serial)


def messages_tool_plan(body: dict[str, Any], prompt_text: str) -> ToolPlan | None:
    """The calls a Messages request is answered with, None for a text answer."""
    calls = call_count(body)
    functions = function_tools(body.get("tools"), _messages_tool, "input_schema")
    if not functions:
        return None
    choice = body.get("tool_choice")
    if choice is not None and not isinstance(choice, dict):
        raise MockHTTPError(400, _MESSAGES_CHOICE, param="tool_choice")
    last = body["messages"][-1]  # checked: an object, with a role
    content = last.get("content")
    blocks = content if isinstance(content, list) else []
    answered = any(isinstance(b, dict) and b.get("type") == "tool_result" for b in blocks)
    asked = last.get("role") == "user" and not answered
    kind = None if choice is None else _MESSAGES_CHOICES.get(str(choice.get("type")), choice)
    chosen = chosen_tool(kind, functions, asked, _messages_choice)
    serial = choice is not None and choice.get("disable_parallel_tool_use") is True
    because = "'tool_choice.disable_parallel_tool_use' is true" if serial else ""
    return make_plan(functions, chosen, calls, prompt_text, serial=because)


def _responses_function(tool: dict[str, Any]) -> dict[str, Any] | None:
    return tool if tool.get("type") == "function" else None


def _messages_tool(tool: dict[str, Any]) -> dict[str, Any] | None:
    """A client tool (no `type`, or "custom"); a hosted one (a `type` naming it) is not called."""
    return tool if tool.get("type") in (None, "custom") else None


def _responses_choice(choice: object) -> str:
    name = _typed_name(choice, "function")
    if name is None:
        raise MockHTTPError(
            400, '\'tool_choice\' must be "none", "auto", "required" or '
            '{"type": "function", "name": ...}.', param="tool_choice",
        )  # fmt: skip
    return name


def _messages_choice(choice: object) -> str:
    name = _typed_name(choice, "tool")
    if name is None:
        raise MockHTTPError(400, _MESSAGES_CHOICE, param="tool_choice")
    return name


def _typed_name(choice: object, kind: str) -> str | None:
    """The `name` of a `tool_choice` object of type `kind`, None when it is not one."""
    if not isinstance(choice, dict) or choice.get("type") != kind:
        return None
    name = choice.get("name")
    return name if isinstance(name, str) else None


@dataclass(frozen=True, slots=True)
class AgentCalls:
    """One answer's calls as far as its `n` tokens go, with the ids it shows them under."""

    plan: ToolPlan
    texts: tuple[str, ...]  # each begun call's arguments (the last cut short when `cut`)
    cut: bool
    item_ids: tuple[str, ...]  # Responses: the items' "fc_..." ids; Messages: "toolu_..."
    call_ids: tuple[str, ...]  # Responses: the calls' call_id

    @classmethod
    def of(cls, plan: ToolPlan, n: int, cut: bool, *, responses: bool) -> AgentCalls:
        texts = tuple(plan.arguments(n))
        prefix = "fc_" if responses else "toolu_"
        item_ids = tuple(prefix + uuid.uuid4().hex[:24] for _ in texts)
        return cls(plan, texts, cut, item_ids, tuple(call_id() for _ in texts))

    def ended_early(self, index: int) -> bool:
        """Whether the output cap cut call `index` short (only the last begun call can be)."""
        return self.cut and index == len(self.texts) - 1

    def function_call(self, index: int, *, done: bool) -> dict[str, Any]:
        """Call `index` as a Responses `function_call` item: as added (not `done`) or whole."""
        status = "incomplete" if self.ended_early(index) else "completed"
        return {
            "id": self.item_ids[index], "type": "function_call", "status":
            status if done else "in_progress", "arguments": self.texts[index] if done else "",
            "call_id": self.call_ids[index], "name": self.plan.names[index],
        }  # fmt: skip

    def tool_use(self, index: int, *, done: bool) -> dict[str, Any]:
        """Call `index` as a Messages `tool_use` block: as started (input {}) or whole."""
        name, text = self.plan.names[index], self.texts[index]
        given = _whole_properties(self.plan, index, text) if done else {}
        return {"type": "tool_use", "id": self.item_ids[index], "name": name, "input": given}


def _whole_properties(plan: ToolPlan, index: int, text: str) -> dict[str, Any]:
    """The arguments of call `index` whose values are whole in `text`, a prefix of them all."""
    full = "".join(piece for at, piece in plan.pieces if at == index)
    arguments: dict[str, Any] = orjson.loads(full)
    if text == full:
        return arguments
    whole: dict[str, Any] = {}
    for name, value in arguments.items():
        ended = {**whole, name: value}
        if len(orjson.dumps(ended)) - 1 > len(text):  # up to the entry's end, no closing brace
            break
        whole = ended
    return whole
