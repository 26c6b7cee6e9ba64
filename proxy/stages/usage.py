"""What a request is billed: the backend's usage if its numbers are sane, else the gateway's own.

Writes input_tokens, output_tokens and usage_source (and upstream_usage, backend_usage).
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

from proxy.apis import AGENT_APIS
from proxy.context import Operation, RequestContext, UsageSource
from proxy.stages.shape import chat_tools, count_prompts, count_template_inputs
from proxy.tokens import TokenCounter, TokenCounters, TokenizerError
from proxy.tokens.base import prompts_of

__all__ = [
    "MAX_USAGE_TOKENS",
    "backend_answered",
    "believed",
    "bill",
    "checked_usage",
    "count_unreported_input",
    "relayed_output",
    "take_usage",
    "usage_of",
]

MAX_USAGE_TOKENS = 100_000_000
"""The most tokens one request may report (prompt or completion): ten times the largest context
window on offer (10M). A backend number above it, negative, a float or a bool is not believed."""

# A stream's token events count from the first text on, so each choice may add a textless
# role or finish event: the gateway's count, less these, is a lower bound on the output tokens.
_TEXTLESS_PER_CHOICE = 2
_FIELDS = ("prompt_tokens", "completion_tokens", "total_tokens")
_LEAST_OVERRULE_4THS = 7
"""An estimate overrules a backend's output count only past 7/4 of it (see `_beats`)."""
_log = logging.getLogger("tokenweir.usage")


def usage_of(answer: dict[str, Any]) -> dict[str, Any] | None:
    """The `usage` object of a whole (non-stream) answer, parsed, if it has one."""
    usage = answer.get("usage")
    return usage if isinstance(usage, dict) else None


def believed(ctx: RequestContext, usage: dict[str, Any]) -> tuple[int, int] | None:
    """(prompt, completion) tokens of the backend's usage (in its API's own names) if every
    number in it is believable, else None. Records nothing: `take_usage` does."""
    api = AGENT_APIS.get(ctx.operation)
    return _judged(ctx, usage if api is None else api.usage(usage))


def _judged(ctx: RequestContext, usage: dict[str, Any]) -> tuple[int, int] | None:
    checked = checked_usage(usage)
    if ctx.operation != "embeddings" and not isinstance(usage.get("completion_tokens"), int):
        return None  # a generation's usage without its output count is not a usage
    # An embedding generates nothing: output it reports is no believable count.
    bound = 0 if ctx.operation == "embeddings" else ctx.outgoing.reserved_output()
    if checked is not None and bound is not None and checked[1] > bound:
        return None  # more output than the bound it was sent with: not a believable count
    return checked


def take_usage(ctx: RequestContext, usage: dict[str, Any] | None) -> None:
    """Keep the backend's usage if every number in it is believable; say so when it is not."""
    if usage is None:
        return
    api = AGENT_APIS.get(ctx.operation)
    if api is not None:
        usage = api.usage(usage)  # each API's own names, read as chat's
    checked = _judged(ctx, usage)
    if checked is None:
        ctx.outcome.usage_rejected = True
        backend = ctx.backend.name if ctx.backend else None
        _log.warning(
            "backend %r reported usage the gateway does not believe (%s); billing its own counts",
            backend,
            orjson.dumps({k: _shown(usage.get(k)) for k in _FIELDS}).decode()[:200],
        )
        return
    ctx.outcome.usage = usage  # what the cache keeps with the answer
    ctx.outcome.backend_usage = checked


def _shown(value: object) -> object:
    """A usage number as the warning shows it: a list or an object by its kind, since it may
    nest past the 254 levels orjson writes (the backend's JSON is read to 1024), an integer
    orjson cannot write by its length, and a string cut short (the line is cut anyway)."""
    if isinstance(value, list | dict):
        return f"<{'array' if isinstance(value, list) else 'object'}>"
    if type(value) is int and not -(2**63) <= value < 2**64:  # read past orjson's 64 bits
        return f"<integer of {len(str(abs(value)))} digits>"
    return value[:50] if isinstance(value, str) else value


def checked_usage(usage: dict[str, Any]) -> tuple[int, int] | None:
    """(prompt, completion) tokens, or None if a field is missing, not an int, or out of range.

    `completion_tokens` may be absent (embeddings); `total_tokens`, when present, must be in
    range too (it is not billed: backends differ on what it includes).
    """
    prompt = _count(usage.get("prompt_tokens"))
    raw_completion = usage.get("completion_tokens", 0)
    completion = _count(0 if raw_completion is None else raw_completion)
    if prompt is None or completion is None:
        return None
    if "total_tokens" in usage and usage["total_tokens"] is not None:
        if _count(usage["total_tokens"]) is None:
            return None
    return prompt, completion


def _count(value: object) -> int | None:
    # bool is an int subclass: `true` must not count as 1
    if type(value) is not int or not 0 <= value <= MAX_USAGE_TOKENS:
        return None
    return value


def bill(ctx: RequestContext, counter: TokenCounter | None) -> None:
    """Decide input_tokens, output_tokens and usage_source, before the quotas are settled.

    A request no backend answered (refused by the gateway, connect refused, a backend error)
    bills nothing. Otherwise the backend's checked usage, unless the gateway counted more output
    (n > 1 on a backend that reports one choice): then the larger, and the record says so.
    """
    if ctx.cached is not None:
        ctx.usage_source = "cache"  # the cache stage set what a hit is charged
        return
    if not backend_answered(ctx):
        ctx.input_tokens = ctx.output_tokens = 0
        ctx.usage_source = None
        return
    exact = counter is None or counter.exact
    counted_out = _counted_output(ctx, counter)
    if ctx.outcome.backend_usage is not None:
        prompt, completion = ctx.outcome.backend_usage
        ctx.input_tokens, ctx.output_tokens = prompt, completion
        ctx.usage_source = "backend"
        if counted_out is not None and _beats(counted_out, completion, ctx, exact):
            ctx.output_tokens = counted_out
            ctx.usage_source = "counted_output"
        return
    ctx.input_tokens = ctx.counted_input_tokens or 0
    ctx.output_tokens = counted_out or 0
    source: UsageSource = "counted" if exact else "estimated"
    ctx.usage_source = source


def backend_answered(ctx: RequestContext) -> bool:
    """True if the client got a backend's answer, or left after a backend took the whole
    request (its work is then billed: a whole answer's head comes only with its body, so a
    client that left before it is billed its prompt); an error status bills only the usage a
    backend reported."""
    if ctx.status == 200:
        return True
    route = ctx.route
    return ctx.outcome.client_disconnected and route is not None and (route.opened or route.sent)


async def count_unreported_input(ctx: RequestContext, counters: TokenCounters) -> None:
    """Count a prompt the backend answered without a believable usage, where shaping did not
    count it (it counts only when a limit needs the count): that count is then the bill."""
    if not backend_answered(ctx) or ctx.cached is not None:
        return
    body = ctx.body
    try:
        api = AGENT_APIS.get(ctx.operation)
        if api is not None:
            chat, tools = api.to_chat(body)
            count = await counters.count_chat(ctx.model, chat, tools)
        elif ctx.operation == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list):
                return
            count = await counters.count_chat(ctx.model, messages, chat_tools(body))
            count += await count_template_inputs(counters, ctx.model, body)
        else:
            count = await count_prompts(counters, ctx.model, ctx.operation, body)
    except (TokenizerError, TypeError, ValueError, AttributeError, KeyError):
        return  # a prompt the counter cannot read was checked by parse; bill it as uncounted
    ctx.counted_input_tokens = count


def _beats(counted: int, reported: int, ctx: RequestContext, exact: bool) -> bool:
    """True if the gateway's output count overrules the backend's: any larger exact count (a
    stream's token events are a lower bound, so exact too). An estimate is off by more than any
    fixed slack, so it overrules only a backend that plainly counted one choice of n: past
    halfway from all n to one, and past 1.75 times the report.

    The estimate reads prose at 0.81-1.13 of Qwen2.5's count, " hello" and the mock backend's
    words (6 characters with their space) at 1.5, a short mock answer up to 1.75 (8 tokens a
    choice; 1.39-1.63 at 64): an honest report. One choice of n reads n times that. Halfway
    (1.5 for n = 2) billed the estimate for half the mock's honest answers of two choices; at
    1.75 a backend counting one of two is caught wherever the estimate reads at least 0.875 of
    the text's tokens (a one-choice report of text it reads at 0.81-0.875 is billed as
    reported). For n >= 3 halfway is 2 or more, above every honest reading."""
    if exact or ctx.stream:
        return counted > reported
    return 4 * counted > reported * max(_LEAST_OVERRULE_4THS, 2 * (ctx.choices + 1))


def _counted_output(ctx: RequestContext, counter: TokenCounter | None) -> int | None:
    """The gateway's own count of the output; None where it has none worth comparing."""
    if ctx.operation == "embeddings":
        return 0
    choices = ctx.choices
    if ctx.stream:
        events = ctx.meter.token_events
        if ctx.operation in AGENT_APIS:
            # The agent APIs' token events are their deltas, in the reads that held text (a
            # delta may be empty).
            return _bounded(ctx, min(events, ctx.meter.texted_events))
        # The events of the chunks that held text: an event without text in a chunk of its
        # own (a filter's verdict) is no token.
        texted = ctx.meter.texted_events
        if ctx.outcome.backend_usage is None:  # the bill itself
            if ctx.outcome.completed:
                return relayed_output(ctx)
            # Broken off: less the events without text beside the last text (forward.py).
            return _bounded(ctx, max(0, texted - ctx.meter.textless_at_end))
        # A lower bound to compare with the backend's: each choice's role and finish events,
        # or its finish in a chunk with text, are no tokens.
        own = min(events - _TEXTLESS_PER_CHOICE * choices, texted - choices)
        return _bounded(ctx, max(0, own))
    # A whole answer is counted only when needed: no usage to believe, or several choices.
    if counter is None or (ctx.outcome.backend_usage is not None and choices == 1):
        return None
    return _count_answer(ctx.outcome.parsed, ctx.operation, counter, _echoed(ctx))


def relayed_output(ctx: RequestContext) -> int:
    """Output tokens a running stream has surely relayed: its token events, less the textless
    finish event each choice may have sent, and no more than the events of the chunks that held
    text (an event without text in a chunk of its own, mid-stream, is no token; nor, once the
    stream ended, one beside the last text). Exact where each event carries one token
    (llama.cpp, the mock backend), a lower bound where events carry several; never above what
    was sent."""
    meter = ctx.meter
    texted = meter.texted_events - meter.textless_at_end
    return _bounded(ctx, max(0, min(meter.token_events - ctx.choices, texted)))


def _bounded(ctx: RequestContext, events: int) -> int:
    """A stream's token events, at most the output its backend was bound to: after the first
    text every event counts as a token unread (the count reads none for text; only the timing
    checks a read for it), so a backend padding a stream with empty events would bill each one."""
    bound = ctx.outgoing.reserved_output()
    return events if bound is None else min(events, bound)


def _echoed(ctx: RequestContext) -> tuple[str | int, ...]:
    """The prompt each choice of a completion begins with under `echo: true`, by the choice's
    index (each prompt's `n` choices in turn, as OpenAI and vLLM number them): its text, or for
    a prompt of token ids how many they are (echoed as their text, which the gateway does not
    decode)."""
    if ctx.body.get("echo") is not True:
        return ()
    if ctx.operation == "chat":
        return (_prefill(ctx.body.get("messages")),)
    if ctx.operation != "text_completion":
        return ()
    prompts = prompts_of(ctx.body.get("prompt"))
    each = ctx.choices // len(prompts)
    return tuple(p if isinstance(p, str) else len(p) for p in prompts for _ in range(each))


def _prefill(messages: object) -> str:
    """What vLLM's chat `echo: true` puts before each choice's content: the last message's, when
    it is the assistant's (its text parts joined by lines, as vLLM joins them)."""
    last = messages[-1] if isinstance(messages, list) and messages else None
    if not isinstance(last, dict) or last.get("role") != "assistant":
        return ""
    content = last.get("content")
    if isinstance(content, list):
        parts = (p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text")
        return "\n".join(text for text in parts if isinstance(text, str))
    return content if isinstance(content, str) else ""


def _unechoed(
    text: str, index: object, position: int, echoed: tuple[str | int, ...], counter: TokenCounter
) -> int:
    """Tokens of `text` without the prompt its choice echoes: the choice's own, by its index
    (its place in the answer if the index is not one), never another prompt's (one prompt may
    begin another, and the longer one would take the output with it). Token ids echoed come
    back as text that reads as about as many tokens: so many are taken off the count."""
    at = index if type(index) is int and 0 <= index < len(echoed) else position
    prompt = echoed[at] if at < len(echoed) else ""
    if isinstance(prompt, int):
        return max(0, counter.count_text(text) - prompt)
    return counter.count_text(text[len(prompt) :] if text.startswith(prompt) else text)


def _count_answer(
    parsed: object, operation: Operation, counter: TokenCounter, echoed: tuple[str | int, ...] = ()
) -> int | None:
    """The output tokens of a whole answer, as the relay parsed it (None: no answer)."""
    api = AGENT_APIS.get(operation)
    if api is not None and isinstance(parsed, dict):
        return sum(counter.count_text(text) for text in api.answer_texts(parsed))
    choices = parsed.get("choices") if isinstance(parsed, dict) else None
    if not isinstance(choices, list):
        return None
    texts: list[str] = []
    completions = 0  # tokens of the completions' texts, each less its echoed prompt
    for position, choice in enumerate(choices):
        if not isinstance(choice, dict):
            continue
        if operation == "text_completion":
            text = choice.get("text")
            if isinstance(text, str):
                completions += _unechoed(text, choice.get("index"), position, echoed, counter)
            continue
        message = choice.get("message")
        if isinstance(message, dict):
            texts.extend(_message_texts(message, str(echoed[0]) if echoed else ""))
    return completions + sum(counter.count_text(text) for text in texts if isinstance(text, str))


def _message_texts(message: dict[str, Any], prefill: str = "") -> list[str]:
    names = ("content", "reasoning_content", "reasoning", "refusal")  # reasoning: vLLM >= 0.11
    texts = [message.get(name) or "" for name in names]
    if prefill and isinstance(texts[0], str) and texts[0].startswith(prefill):
        texts[0] = texts[0][len(prefill) :]  # echoed, not generated
    calls = message.get("tool_calls")
    legacy = {"function": message.get("function_call")}  # the answer to the legacy `functions`
    for call in [*(calls if isinstance(calls, list) else ()), legacy]:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            texts += [function.get("name") or "", function.get("arguments") or ""]
    return texts
