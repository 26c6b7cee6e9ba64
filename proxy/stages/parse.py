"""Parse and check the body as OpenAI would, and that the tenant may use the model.

Writes body, model, stream, client_wants_usage, and the number of answers asked for (the
choices the client gets, the answers the backend generates).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import orjson

from proxy.apis import AGENT_APIS, output_default, output_fields
from proxy.context import Admitted, Operation
from proxy.errors import BadRequest, GatewayError, InvalidJSON, ModelNotFound, PermissionDenied
from proxy.outgoing import OutgoingRequest
from proxy.stages.jsoncheck import Check, boolean, fields, invalid_type, missing
from proxy.stages.openai_schema import CHAT, COMPLETIONS, EMBEDDINGS, MESSAGES, PROMPT
from proxy.tokens.base import prompt_count

__all__ = ["MAX_DEPTH", "Parse", "check_fields"]

# orjson reads 1024 levels of nesting but writes only 254, and the body must be written again
# for the backend (and the cache key); deeper bodies are refused here, naming the field.
MAX_DEPTH = 254
# Per operation: its required field, and every field's check, the required one's first.
_SCHEMAS: dict[Operation, tuple[tuple[str], Mapping[str, Check]]] = {
    "chat": (("messages",), {"messages": MESSAGES, **CHAT}),
    "text_completion": (("prompt",), {"prompt": PROMPT, **COMPLETIONS}),
    "embeddings": (("input",), {"input": EMBEDDINGS["input"], **EMBEDDINGS}),
}
_STREAM_OPTIONS = fields({"include_usage": boolean})


class Parse:
    def __init__(self, models: Collection[str]) -> None:
        self._models = frozenset(models)

    async def __call__(self, ctx: Admitted) -> None:
        body = self.read(ctx)
        api = AGENT_APIS.get(ctx.operation)
        if api is not None:
            check_fields(body, api.required, api.checks)
            ctx.stream = body.get("stream") is True
            ctx.client_wants_usage = True  # usage is part of these streams' own events
            return
        required, checks = _SCHEMAS[ctx.operation]
        check_fields(body, required, checks)
        if ctx.operation != "embeddings":
            ctx.stream = body.get("stream") is True
            ctx.client_wants_usage = _stream_options(body, ctx.stream)
            ctx.outgoing.choices, ctx.outgoing.answers = _answers(body, ctx.operation == "chat")

    def read(self, ctx: Admitted) -> dict[str, Any]:
        """The body as a JSON object, its model one the tenant may use: the outgoing request."""
        try:
            body = _load(ctx.raw_body)
        except InvalidJSON:
            _check_encoding(ctx.headers.get("content-encoding"))
            _check_transfer_coding(ctx.headers.get("transfer-encoding"))
            raise
        operation = ctx.operation
        ctx.outgoing = OutgoingRequest(
            body, _model(body), output_fields(operation), output_default(operation)
        )
        self._check_access(ctx)
        _check_depth(ctx.raw_body, body)
        return body

    def _check_access(self, ctx: Admitted) -> None:
        if ctx.model not in self._models:
            raise ModelNotFound.named(ctx.model)
        if ctx.model not in ctx.tenant.models:
            raise PermissionDenied(
                f"Your API key may not use the model `{ctx.model}`.", param="model"
            )


def check_fields(
    body: dict[str, Any], required: tuple[str, ...], checks: Mapping[str, Check]
) -> None:
    """Each required field present, and each field with a check valid where it is present; of
    several invalid fields, the one reported is the first in `checks`' order."""
    for name in required:
        if body.get(name) is None:
            raise missing(name)
    try:
        for field, value in body.items():  # a body has a few of the fields `checks` knows
            field_check = checks.get(field)
            if field_check is not None and value is not None:
                field_check(value, field)
    except GatewayError as error:
        raise _first_invalid(body, checks) or error from None


def _first_invalid(body: dict[str, Any], checks: Mapping[str, Check]) -> GatewayError | None:
    """The error of the first field in `checks`' order that fails its check."""
    for field, field_check in checks.items():
        value = body.get(field)
        if value is not None:
            try:
                field_check(value, field)
            except GatewayError as error:
                return error
    return None


def _load(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if str(exc).startswith("depth limit exceeded"):
            raise InvalidJSON(
                "The JSON body nests arrays and objects more than 1024 levels deep; this "
                f"gateway accepts at most {MAX_DEPTH}."
            ) from None
        why = _not_utf8(raw) if str(exc).startswith("str is not valid UTF-8") else exc
        raise InvalidJSON(
            f"We could not parse the JSON body of your request ({why}). (HINT: This likely means "
            "you aren't using your HTTP library correctly. The OpenAI API expects a JSON payload.)"
        ) from None
    if not isinstance(body, dict):
        raise InvalidJSON("The request body must be a JSON object.")
    return body


def _not_utf8(raw: bytes) -> str:
    """Where a body stops being UTF-8 (orjson says only that it is not, at its first byte, and
    that "surrogates [are] not allowed" whatever the bytes are: Latin-1's café, UTF-16)."""
    try:
        raw.decode()
    except UnicodeDecodeError as exc:
        at, bad = exc.start, raw[exc.start : exc.end].hex(" ").upper()
        line = raw.count(b"\n", 0, at) + 1
        column = len(raw[raw.rfind(b"\n", 0, at) + 1 : at].decode()) + 1
        utf16 = " (a UTF-16 or UTF-32 byte order mark)" if raw.startswith(_UTF16_BOMS) else ""
        return f"bytes not valid UTF-8: {bad} at byte {at}{utf16}: line {line} column {column}"
    return "bytes not valid UTF-8"


_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff", b"\x00\x00\xfe\xff")


def _check_encoding(encoding: str | None) -> None:
    """A body that is not JSON because it came compressed is told so (looked at only then: a
    body that parses is taken whatever the header says)."""
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        raise BadRequest(
            f"The request body has Content-Encoding: {encoding[:40]}; this gateway accepts only "
            "uncompressed JSON bodies. Send the body without compressing it.",
            code="unsupported_content_encoding",
        )


def _check_transfer_coding(coding: str | None) -> None:
    """The same for a body sent with a transfer coding besides chunked (`gzip, chunked`): the
    server takes its chunks off, not the compression."""
    codings = [] if coding is None else [c.strip().lower() for c in coding.split(",")]
    if any(c not in ("", "chunked", "identity") for c in codings):
        raise BadRequest(
            f"The request body has Transfer-Encoding: {coding[:40] if coding else ''}; this "
            "gateway accepts only chunked or plain bodies of uncompressed JSON.",
            code="unsupported_transfer_encoding",
        )


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise BadRequest("you must provide a model parameter", param="model", code="missing")
    if not isinstance(model, str) or not model:
        raise invalid_type("model", "a non-empty string", model)
    return model


def _check_depth(raw: bytes, body: dict[str, Any]) -> None:
    """Refuse a body nested deeper than MAX_DEPTH. Fewer brackets than that cannot nest that
    deep, so most bodies are let through on a count; the others are written once to see."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return
    try:
        orjson.dumps(body)
    except orjson.JSONEncodeError:
        param = _too_deep(body)
        raise BadRequest(
            f"Invalid '{param}': arrays and objects nested more than {MAX_DEPTH} levels deep.",
            param=param,
            code="invalid_value",
        ) from None


def _too_deep(body: dict[str, Any]) -> str:
    """The top-level field nested too deep, and its element or member when it has one."""
    for name, value in body.items():
        if _writable([value]):
            continue
        members = enumerate(value) if isinstance(value, list) else (value or {}).items()
        for key, member in members:
            if not _writable([[member]]):
                return f"{name}[{key}]" if isinstance(value, list) else f"{name}.{key}"
        return name
    return "body"


def _writable(value: object) -> bool:
    try:
        orjson.dumps(value)
    except orjson.JSONEncodeError:
        return False
    return True


def _answers(body: dict[str, Any], chat: bool) -> tuple[int, int]:
    """How many answers the client gets, and how many the backend generates: `n` (for
    completions, `best_of` when larger, as the backend generates them all), for each prompt of
    a completions batch."""
    each: int = body.get("n") or 1
    if chat:
        return each, each
    best_of = body.get("best_of")
    generated = best_of if best_of is not None and best_of > each else each
    prompts = prompt_count(body["prompt"])
    return each * prompts, generated * prompts


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise BadRequest(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
            code="invalid_value",
        )
    _STREAM_OPTIONS(options, "stream_options")
    return options.get("include_usage") is True
