"""What a client is shown of its bill: where the backend's usage was not believed (missing,
malformed, out of bounds), or the gateway counted more output (`counted_output`), the answer
carries the usage billed instead, written once the request is settled (`Outcome.reshow`). An
answer billed as its backend's usage says goes out untouched."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Final

import orjson

from proxy.context import RequestContext
from proxy.jsontext import json_text
from proxy.upstream.exactints import as_written
from proxy.usageshape import responses_usage

__all__ = [
    "Reshow",
    "added_usage_chunk",
    "billed_usage",
    "event_with_billed",
    "usage_chunk_if_overruled",
    "whole_with_billed",
]

Reshow = Callable[[RequestContext, bytes], bytes]
"""The answer's last bytes as the client is to see them, given the request as billed."""

_DATA: Final = b"data:"
_DECODER: Final = json.JSONDecoder()
_SPACE: Final = re.compile(r"[ \t\n\r]*")
_CHUNK_OBJECTS: Final = {"chat": "chat.completion.chunk", "text_completion": "text_completion"}


def billed_usage(ctx: RequestContext) -> dict[str, Any]:
    """The request's bill as its API writes usage. The details a backend may add (cached,
    reasoning) are not counted apart by the gateway: the Responses API's are 0, as are the
    Messages API's cache counts (its input is all of the input billed)."""
    prompt, output = ctx.input_tokens or 0, ctx.output_tokens or 0
    operation = ctx.operation
    if operation == "messages":
        cache = {"cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        return {"input_tokens": prompt, "output_tokens": output, **cache}
    if operation == "responses":
        return responses_usage(prompt, output)
    if operation == "embeddings":
        return {"prompt_tokens": prompt, "total_tokens": prompt}
    return {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output}


def whole_with_billed(parsed: dict[str, Any], raw: bytes, *, as_sent: bool) -> Reshow:
    """A whole answer (`raw`, parsed) whose `usage` is the bill. Big integers elsewhere in it
    stay as the backend wrote them; so does all of an answer orjson could not read (`NaN`, a
    lone surrogate: not `as_sent`, proxy/upstream/wellformed.py), whose usage is written in
    place."""

    def reshow(ctx: RequestContext, body: bytes) -> bytes:
        if body is not raw or ctx.usage_source == "backend":
            return body
        usage = billed_usage(ctx)
        if not as_sent:
            return _spliced(raw, orjson.dumps(usage)) or raw
        return _encoded({**parsed, "usage": usage}, raw)

    return reshow


def event_with_billed(held: bytes, parsed: object) -> Reshow:
    """A stream's `held` event (whole, its end included; `parsed`, its data's JSON, or None if
    it was none) with the bill as its usage: a chat or completions usage chunk, a Messages
    `message_delta`, a Responses `response.completed` (or its incomplete or failed twin)."""

    def reshow(ctx: RequestContext, body: bytes) -> bytes:
        at = -1 if ctx.usage_source == "backend" else body.find(held)
        if at < 0:
            return body  # the stream ended otherwise: the gateway's error event
        payload = _encoded(_with_usage(ctx, parsed), held)
        return body[:at] + _as_event(held, payload) + body[at + len(held) :]

    return reshow


def added_usage_chunk(ctx: RequestContext, body: bytes) -> bytes:
    """A chat or completions stream's end, with a usage chunk of the bill before its `[DONE]`:
    the client asked for usage (`stream_options.include_usage`) and the backend sent none."""
    chunk = _with_usage(ctx, None)
    event = b"data: " + orjson.dumps(chunk) + b"\n\n"
    done = body.rfind(b"[DONE]")
    at = body.rfind(_DATA, 0, done) if done >= 0 else -1
    return body + event if at < 0 else body[:at] + event + body[at:]


def usage_chunk_if_overruled(ctx: RequestContext, body: bytes) -> bytes:
    """A stream's end whose usage went out with its last choices (llama.cpp's), believed: as it
    came if it is the bill, else with a usage chunk of the bill after it, the last one the
    client reads."""
    return body if ctx.usage_source == "backend" else added_usage_chunk(ctx, body)


def _with_usage(ctx: RequestContext, parsed: object) -> dict[str, Any]:
    usage = billed_usage(ctx)
    if ctx.operation == "responses" and isinstance(parsed, dict):
        response = parsed.get("response")
        return {**parsed, "response": {**(response if isinstance(response, dict) else {}),
                                       "usage": usage}}  # fmt: skip
    if isinstance(parsed, dict):
        return {**parsed, "usage": usage}
    # No JSON object to keep: a chunk of the gateway's own, as OpenAI writes one.
    return {
        "id": f"chatcmpl-{ctx.request_id}",
        "object": _CHUNK_OBJECTS.get(ctx.operation, "chat.completion.chunk"),
        "created": int(ctx.received_wall),
        "model": ctx.model,
        "choices": [],
        "usage": usage,
    }


def _encoded(item: dict[str, Any], raw: bytes) -> bytes:
    """`item` as JSON, each integer past 64 bits as `raw` (the backend's bytes) wrote it."""
    try:
        content = orjson.dumps(item)
    except orjson.JSONEncodeError:  # nested past the 254 levels orjson writes (it reads 1024)
        return json_text(item).encode()
    return as_written(content, item, raw)


def _spliced(raw: bytes, usage: bytes) -> bytes | None:
    """`raw`, a JSON object, with its (last) top-level `usage` value as `usage`, or `usage`
    added; None if Python's reader cannot walk it (it read it already: not expected)."""
    try:
        text = raw.decode()
        spans = _top_level_values(text, "usage")
    except (ValueError, RecursionError, IndexError):
        return None
    if spans:
        start, end = spans[-1]  # the one a JSON reader keeps
        return (text[:start] + usage.decode() + text[end:]).encode()
    close = text.rstrip().rfind("}")
    return (text[:close] + ',"usage":' + usage.decode() + text[close:]).encode()


def _top_level_values(text: str, name: str) -> list[tuple[int, int]]:
    """Where each value of the top-level key `name` lies in the JSON object `text`."""
    decoder = _DECODER
    at = _skip(text, 0)
    if text[at] != "{":
        raise ValueError("no object")
    at = _skip(text, at + 1)
    spans: list[tuple[int, int]] = []
    while text[at] != "}":
        key, at = decoder.raw_decode(text, at)
        at = _skip(text, at)
        if text[at] != ":":
            raise ValueError("no colon")
        start = _skip(text, at + 1)
        _, at = decoder.raw_decode(text, start)
        if key == name:
            spans.append((start, at))
        at = _skip(text, at)
        if text[at] == ",":
            at = _skip(text, at + 1)
    return spans


def _skip(text: str, at: int) -> int:
    """Where the JSON whitespace from `at` on ends."""
    space = _SPACE.match(text, at)
    return at if space is None else space.end()


def _as_event(held: bytes, payload: bytes) -> bytes:
    """`held` with its data lines as one carrying `payload`; its other lines (`event:`) and its
    end as they came."""
    lines: list[bytes] = []
    placed = False
    for line in held.splitlines(keepends=True):
        if line.startswith(_DATA):
            if not placed:
                placed = True
                end = b"\r\n" if line.endswith(b"\r\n") else b"\n"
                lines.append(b"data: " + payload + end)
            continue
        lines.append(line)
    return b"".join(lines)
