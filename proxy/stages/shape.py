"""Shape a request to its tenant's budget card: system prompt, history, input and output limits,
temperature. Counts the input once, and only when an input limit or a quota needs the count.
Writes body, shaped, counted_input_tokens, output_allowance (per answer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import orjson

from proxy.apis import AGENT_APIS, AgentApi
from proxy.apis.responses import names_stored_item
from proxy.context import Admitted, Operation
from proxy.errors import BadRequest, ContextLengthExceeded
from proxy.outgoing import OutgoingRequest
from proxy.policy.model import Budget, Tenant
from proxy.stages.degrade import spilled_to
from proxy.tokens import TokenizerError
from proxy.tokens.base import prompt_count

__all__ = [
    "InputCounter",
    "Shape",
    "chat_tools",
    "count_prompts",
    "count_template_inputs",
]

Message = Mapping[str, Any]
_SYSTEM_ROLES = frozenset({"system", "developer"})
# A tool's result answers the assistant's call before it (`function`: the legacy role).
_RESULT_ROLES = frozenset({"tool", "function"})
# Responses only (Messages has none): a stored conversation, or a stored prompt template
_STORED_HISTORY = ("previous_response_id", "conversation", "prompt")
# Chat fields vLLM hands its chat template beside the messages
_TEMPLATE_INPUTS = ("documents", "chat_template_kwargs")


class InputCounter(Protocol):
    """What shaping needs of the token counters: prompt tokens as the backend will bill them."""

    async def count_chat(
        self,
        model: str,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> int: ...

    async def count_prompt(self, model: str, prompt: Any) -> int: ...


class Shape:
    def __init__(self, counter: InputCounter) -> None:
        self._counter = _Checked(counter)

    async def __call__(self, ctx: Admitted) -> None:
        tenant, outgoing = ctx.tenant, ctx.outgoing
        budget = tenant.budget
        rule = ctx.degrade_choice[0] if ctx.degrade_choice is not None else None
        spill = spilled_to(rule, ctx.operation)
        try:
            await self.shape_input(ctx, tenant, ctx.model if spill is None else spill)
        except ContextLengthExceeded:
            if rule is not None and spill is not None and spill != ctx.model:
                # Counted for the model the rule sends it to: the client's own count of the
                # model it asked for may fit, so the answer names the rule.
                ctx.degraded.append(rule.name)
            raise
        if ctx.operation != "embeddings":
            if budget.max_output_tokens is not None:
                outgoing.bound_output(budget.max_output_tokens, "max_tokens")  # and the allowance
            else:
                outgoing.allow_as_sent(held=_charges_output(tenant))
            _temperature(outgoing, budget)

    async def shape_input(self, ctx: Admitted, tenant: Tenant, model: str) -> None:
        """The messages (or prompt) and their count, with `model`'s tokenizer: the model that
        serves the request, another when the degradation rule chosen sends it there."""
        budget, outgoing = tenant.budget, ctx.outgoing
        api = AGENT_APIS.get(ctx.operation)
        if ctx.operation == "chat":
            await self._shape_chat(ctx, tenant, model)
        elif api is not None:
            await self._shape_agent(ctx, tenant, api, model)
        elif _needs_count(ctx):
            if budget.max_input_tokens is not None and outgoing.body.get("prompt_embeds"):
                # vLLM's prompt embeddings: tensors, read as many tokens as they have rows
                raise _uncountable("prompt_embeds", "the prompt's embeddings", budget)
            count = await count_prompts(self._counter, model, ctx.operation, outgoing.body)
            if budget.max_input_tokens is not None and count > budget.max_input_tokens:
                field = "prompt" if ctx.operation == "text_completion" else "input"
                raise _too_long(count, budget.max_input_tokens, field)
            ctx.counted_input_tokens = count

    async def _shape_chat(self, ctx: Admitted, tenant: Tenant, model: str) -> None:
        budget = tenant.budget
        outgoing = ctx.outgoing
        messages: list[Message] = list(outgoing.body["messages"])
        shaped: list[str] = []
        if budget.system_prompt is not None and not _starts_with(messages, budget.system_prompt):
            messages.insert(0, {"role": "system", "content": budget.system_prompt})
            shaped.append("system_prompt")
        if budget.history_limit is not None:
            kept = _last_turns(messages, budget.history_limit)
            if len(kept) < len(messages):
                messages = kept
                shaped.append("history")
        if budget.max_input_tokens is not None:
            _refuse_request_template(outgoing.body, budget)
        if _needs_count(ctx):
            tools = chat_tools(outgoing.body)
            extra = await count_template_inputs(self._counter, model, outgoing.body)
            count = extra + await self._counter.count_chat(model, messages, tools)
            limit = budget.max_input_tokens
            if limit is not None and count > limit:
                if budget.on_input_overflow == "reject":
                    raise _too_long(count, limit)
                messages, count = await self._trim(model, messages, tools, limit, extra)
                shaped.append("input")
            ctx.counted_input_tokens = count
        if shaped:
            outgoing.set_messages(messages, shaped)

    async def _shape_agent(self, ctx: Admitted, tenant: Tenant, api: AgentApi, model: str) -> None:
        """The Responses and Messages APIs: the system prompt and the input limit (an input
        over it is refused; these APIs' histories are not trimmed)."""
        budget = tenant.budget
        if budget.system_prompt is not None and api.add_system(ctx.body, budget.system_prompt):
            ctx.outgoing.record("system_prompt")  # the API's own rules put it in place
        if budget.max_input_tokens is not None:
            _refuse_stored_history(ctx.body, budget.max_input_tokens)
            _refuse_request_template(ctx.body, budget)
            if ctx.body.get("previous_input_messages") is not None:
                # vLLM's Responses: earlier turns in its own (harmony) form, before the input
                raise _uncountable("previous_input_messages", "the turns it holds", budget)
        if _needs_count(ctx):
            messages, tools = api.to_chat(ctx.body)
            count = await self._counter.count_chat(model, messages, tools)
            if budget.max_input_tokens is not None and count > budget.max_input_tokens:
                raise _too_long(count, budget.max_input_tokens, api.required[0])
            ctx.counted_input_tokens = count

    async def _trim(
        self, model: str, messages: list[Message], tools: Any, limit: int, extra: int
    ) -> tuple[list[Message], int]:
        """Drop the oldest turns until the rest and the `extra` tokens beside them fit: the
        fewest drops, found by bisection."""
        head, turns = _split_system(messages)
        cuts = _turn_starts(turns)
        low, high = 0, len(cuts) - 1  # cuts[-1] keeps only the newest turn
        best: tuple[list[Message], int] | None = None
        while low <= high:
            middle = (low + high) // 2
            candidate = head + turns[cuts[middle] :]
            count = extra + await self._counter.count_chat(model, candidate, tools)
            if count <= limit:
                best, high = (candidate, count), middle - 1
            else:
                low = middle + 1
        if best is None:
            newest = await self._counter.count_chat(model, head + turns[cuts[-1] :], tools)
            raise _too_long(extra + newest, limit)
        return best


def chat_tools(body: Mapping[str, Any]) -> list[Any] | None:
    """A chat request's tool definitions as the counters read them: its `tools`, and each of the
    legacy `functions` as a function tool (OpenAI renders both into the prompt and bills them)."""
    tools, functions = body.get("tools"), body.get("functions")
    if not functions:  # nearly every request: the tools as they are
        return tools or None
    declared = list(tools) if isinstance(tools, list) else []
    if isinstance(functions, list):
        declared += [{"type": "function", "function": function} for function in functions]
    return declared or None


async def count_template_inputs(counter: InputCounter, model: str, body: Mapping[str, Any]) -> int:
    """Input tokens a chat's template renders beside its messages: vLLM's `documents` and
    `chat_template_kwargs`, by the text they hold."""
    rendered = _template_inputs(body)
    return await counter.count_prompt(model, rendered) if rendered else 0


async def count_prompts(
    counter: InputCounter, model: str, operation: Operation, body: Mapping[str, Any]
) -> int:
    """Input tokens of a completions or embeddings request: its `prompt` (or `input`), and a
    completion's `suffix` once for each prompt (a fill-in-the-middle backend, Ollama's, reads it
    as input beside each)."""
    if operation != "text_completion":
        return await counter.count_prompt(model, body["input"])
    prompt = body["prompt"]
    count = await counter.count_prompt(model, prompt)
    suffix = body.get("suffix")
    if isinstance(suffix, str) and suffix:
        count += prompt_count(prompt) * await counter.count_prompt(model, suffix)
    return count


class _Checked:
    """A counter whose refusals (a chat template rejecting the conversation) are 400s."""

    def __init__(self, counter: InputCounter) -> None:
        self._counter = counter

    async def count_chat(self, model: str, messages: Sequence[Message], tools: Any = None) -> int:
        try:
            return await self._counter.count_chat(model, messages, tools)
        except TokenizerError as exc:
            raise BadRequest(
                f"The messages do not fit the model's chat format: {exc}",
                param="messages",
                code="invalid_value",
            ) from exc

    async def count_prompt(self, model: str, prompt: Any) -> int:
        try:
            return await self._counter.count_prompt(model, prompt)
        except TokenizerError as exc:
            raise BadRequest(f"The input cannot be counted: {exc}", code="invalid_value") from exc


def _needs_count(ctx: Admitted) -> bool:
    tenant = ctx.tenant
    return (
        tenant.budget.max_input_tokens is not None
        or _charges_tokens(tenant)
        or ctx.key_counts_tokens
    )


def _charges_output(tenant: Tenant) -> bool:
    """A quota or tokens_per_minute counts on the answer's bound: the backend must get it."""
    return _charges_tokens(tenant) or bool(tenant.limits.per_model)


def _charges_tokens(tenant: Tenant) -> bool:
    """A quota or the tenant's tokens_per_minute charges the request's tokens."""
    budget = tenant.budget
    return any(
        limit is not None
        for limit in (
            budget.tokens_per_day,
            budget.tokens_per_month,
            budget.usd_per_day,
            budget.usd_per_month,
            tenant.limits.tokens_per_minute,
        )
    )


def _starts_with(messages: Sequence[Message], system_prompt: str) -> bool:
    first = messages[0] if messages else None
    return (
        first is not None
        and first.get("role") == "system"
        and first.get("content") == system_prompt
    )


def _split_system(messages: Sequence[Message]) -> tuple[list[Message], list[Message]]:
    """The system messages (moved to the front) and the conversation turns, in order."""
    head = [m for m in messages if m.get("role") in _SYSTEM_ROLES]
    return head, [m for m in messages if m.get("role") not in _SYSTEM_ROLES]


def _turn_starts(turns: Sequence[Message]) -> list[int]:
    """Where the kept history may begin: at a user message (so no reply or tool result is left
    without its question) or, after the newest one (an agent's tool rounds), at any message but
    a tool result (so no result is left without the call it answers: OpenAI refuses that)."""
    newest_user = max((i for i, m in enumerate(turns) if m.get("role") == "user"), default=-1)
    starts = [
        i
        for i, m in enumerate(turns)
        if m.get("role") == "user" or (i > newest_user and m.get("role") not in _RESULT_ROLES)
    ]
    return starts or [0]  # only tool results, the client's own: kept whole


def _last_turns(messages: Sequence[Message], limit: int) -> list[Message]:
    """The system messages and the last `limit` other messages from the first turn start among
    them; where none is (tool results only), from the turn start before them, over the limit."""
    head, turns = _split_system(messages)
    keep_from = max(0, len(turns) - max(1, limit))
    starts = _turn_starts(turns)
    kept = [i for i in starts if i >= keep_from]
    return head + turns[kept[0] if kept else starts[-1] :]


def _temperature(outgoing: OutgoingRequest, budget: Budget) -> None:
    wanted = outgoing.body.get("temperature")
    if budget.temperature is not None:
        chosen: float | None = budget.temperature
    elif budget.temperature_max is not None:
        # An omitted temperature means 1.0 to OpenAI-compatible servers.
        effective = 1.0 if wanted is None else wanted
        if effective <= budget.temperature_max:
            return
        chosen = budget.temperature_max
    else:
        return
    if chosen != wanted:
        outgoing.set_field("temperature", chosen, "temperature")


def _refuse_stored_history(body: Mapping[str, Any], limit: int) -> None:
    """A Responses request that continues a stored conversation (`previous_response_id`,
    `conversation`) or names a stored prompt template (`prompt`) has an input the gateway never
    sees: the backend adds the stored turns or prompt, so the key's input limit could not be
    held. Refused; the client can send them as input."""
    for param in _STORED_HISTORY:
        if body.get(param) is not None:
            raise _stored(param, limit)
    given = body.get("input")
    if type(given) is list:
        for index, item in enumerate(given):
            if names_stored_item(item):
                raise _stored(f"input[{index}]", limit)


def _stored(param: str, limit: int) -> BadRequest:
    return BadRequest(
        f"'{param}' cannot be used with this key: the backend would add stored input "
        f"the gateway cannot count against the key's limit of {limit} input tokens. "
        "Send the conversation's turns or the prompt in 'input' instead.",
        param=param,
        code="unsupported_parameter",
    )


def _refuse_request_template(body: Mapping[str, Any], budget: Budget) -> None:
    """A chat template sent with the request (vLLM's `chat_template`, also read from
    `chat_template_kwargs`) replaces the model's: the backend renders the messages through it,
    into any number of tokens, while the gateway counts them with the model's own template.
    Refused under an input limit, which the count could not hold (as a stored history is)."""
    kwargs = body.get("chat_template_kwargs")
    if body.get("chat_template") is not None:
        raise _uncountable("chat_template", "the messages through its template", budget)
    if isinstance(kwargs, Mapping) and kwargs.get("chat_template") is not None:
        param = "chat_template_kwargs.chat_template"
        raise _uncountable(param, "the messages through its template", budget)


def _uncountable(param: str, read: str, budget: Budget) -> BadRequest:
    """The refusal of a field whose input the backend reads, uncounted, under an input limit."""
    return BadRequest(
        f"'{param}' cannot be used with this key: the backend would read {read}, which the "
        f"gateway cannot count against the key's limit of {budget.max_input_tokens} input "
        "tokens. Send the request without it.",
        param=param,
        code="unsupported_parameter",
    )


def _template_inputs(body: Mapping[str, Any]) -> str:
    """The text a vLLM chat template renders into the prompt beside the messages: the strings in
    `documents` (RAG templates) and `chat_template_kwargs`, their objects' keys and their
    numbers, booleans and nulls included.
    Counted as prompt tokens, so that neither carries input past a key's limit or its
    reservation unseen."""
    stack = [body[name] for name in _TEMPLATE_INPUTS if name in body]
    if not stack:  # nearly every request: no list built, no ABC checked
        return ""
    texts: list[str] = []
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, Mapping):
            # Keys too: a template renders them (`tojson`, a document's `items()`).
            texts.extend(key for key in value if isinstance(key, str))
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        else:  # a number, true, false or null: a template writes it too (`tojson`, `{{ x }}`)
            texts.append(orjson.dumps(value).decode())
    return "\n".join(texts)


def _too_long(count: int, limit: int, param: str = "messages") -> ContextLengthExceeded:
    """The refusal of an input over the limit, naming the field that holds it."""
    return ContextLengthExceeded(
        f"This request's input is {count} tokens, over this key's limit of {limit} input tokens. "
        f"Please shorten the {param}.",
        param=param,
    )
