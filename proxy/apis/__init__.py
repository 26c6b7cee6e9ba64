"""The agent APIs served beside chat, OpenAI's Responses and Anthropic's Messages: what the
stages need to know of each (its fields, output cap, usage shape, stream events), by operation.

Both are forwarded to the backend's route of the same name, never translated to chat.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from proxy.apis import messages, responses
from proxy.apis.events import EventForwarder, StreamEvents
from proxy.context import Operation
from proxy.stages.jsoncheck import Check

__all__ = [
    "AGENT_APIS",
    "COMPLETIONS_MAX_TOKENS",
    "AgentApi",
    "EventForwarder",
    "output_default",
    "output_fields",
]

Body = Mapping[str, Any]
ChatView = tuple[list[dict[str, Any]], list[dict[str, Any]] | None]


@dataclass(frozen=True, slots=True)
class AgentApi:
    """One API: how its requests are checked, capped and counted, and its answers billed."""

    required: tuple[str, ...]  # the fields every request carries
    checks: Mapping[str, Check]  # checks of the fields the gateway reads, where present
    output_field: str  # the client's cap on output tokens
    answer_list: str  # the list a whole 200 answer must carry
    to_chat: Callable[[Body], ChatView]  # the input as chat messages and tools, to count it
    usage: Callable[[Mapping[str, Any]], dict[str, Any]]  # its usage in chat's names
    answer_texts: Callable[[Mapping[str, Any]], list[str]]  # generated texts of a whole answer
    add_system: Callable[[dict[str, Any], str], bool]  # put the tenant's system prompt first
    events: StreamEvents  # how its stream marks text deltas, usage and its end


AGENT_APIS: Mapping[Operation, AgentApi] = {
    "responses": AgentApi(
        required=("input",),
        checks={"input": responses.INPUT, **responses.OPTIONAL},
        output_field="max_output_tokens",
        answer_list="output",
        to_chat=responses.to_chat,
        usage=responses.chat_usage,
        answer_texts=responses.answer_texts,
        add_system=responses.add_system,
        events=responses.EVENTS,
    ),
    "messages": AgentApi(
        required=("messages", "max_tokens"),
        checks={"messages": messages.MESSAGES, **messages.OPTIONAL},
        output_field="max_tokens",
        answer_list="content",
        to_chat=messages.to_chat,
        usage=messages.chat_usage,
        answer_texts=messages.answer_texts,
        add_system=messages.add_system,
        events=messages.EVENTS,
    ),
}

# Chat has two names for its cap; every chat backend reads max_tokens (Ollama and TGI only it),
# vLLM prefers max_completion_tokens. Completions backends read max_tokens alone.
_CHAT_OUTPUT_FIELDS = ("max_completion_tokens", "max_tokens")
_OUTPUT_FIELD = ("max_tokens",)
# What a completion without `max_tokens` generates at OpenAI and in vLLM (the API's default).
COMPLETIONS_MAX_TOKENS = 16


def output_fields(operation: Operation) -> tuple[str, ...]:
    """The body fields that cap an operation's output; the last is the one every backend of
    the operation reads, which carries the gateway's bound."""
    api = AGENT_APIS.get(operation)
    if api is not None:
        return (api.output_field,)
    return _CHAT_OUTPUT_FIELDS if operation == "chat" else _OUTPUT_FIELD


def output_default(operation: Operation) -> int | None:
    """The bound an API gives an answer whose body sets none (None: its context's room)."""
    return COMPLETIONS_MAX_TOKENS if operation == "text_completion" else None
