"""Parse and check the body as OpenAI would, and that the tenant may use the model.

Writes body, model, stream, client_wants_usage.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import orjson

from proxy.context import RequestContext
from proxy.errors import BadRequest, InvalidJSON, ModelNotFound, PermissionDenied

__all__ = ["MAX_TOKENS_CAP", "Parse"]

# Far beyond any model's context; a larger value is a client bug, not a request.
MAX_TOKENS_CAP = 1_000_000
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_TYPE_NAMES = {int: "an integer", bool: "a boolean", float: "a number", str: "a string"}


class Parse:
    def __init__(self, models: Collection[str]) -> None:
        self._models = frozenset(models)

    async def __call__(self, ctx: RequestContext) -> None:
        body = _load(ctx.raw_body)
        ctx.body = body
        ctx.model = _model(body)
        self._check_access(ctx)
        if ctx.operation == "chat":
            _check_messages(body)
        elif ctx.operation == "text_completion":
            _check_input(body, "prompt")
        else:
            _check_input(body, "input")
            _check_int(body, "dimensions", 1, 65_536)
            return
        ctx.stream = _check_type(body, "stream", bool) or False
        ctx.client_wants_usage = _stream_options(body, ctx.stream)
        _check_int(body, "max_tokens", 1, MAX_TOKENS_CAP)
        _check_int(body, "max_completion_tokens", 1, MAX_TOKENS_CAP)
        _check_int(body, "n", 1, 128)
        _check_number(body, "temperature", 0.0, 2.0)
        _check_number(body, "top_p", 0.0, 1.0)

    def _check_access(self, ctx: RequestContext) -> None:
        if ctx.model not in self._models:
            raise ModelNotFound(
                f"The model `{ctx.model}` does not exist or you do not have access to it.",
                param="model",
            )
        if ctx.tenant is None or ctx.model not in ctx.tenant.models:
            raise PermissionDenied(
                f"Your API key may not use the model `{ctx.model}`.", param="model"
            )


def _load(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise InvalidJSON(
            "We could not parse the JSON body of your request. (HINT: This likely means you "
            "aren't using your HTTP library correctly. The OpenAI API expects a JSON payload.)"
        ) from None
    if not isinstance(body, dict):
        raise InvalidJSON("The request body must be a JSON object.")
    return body


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise BadRequest("you must provide a model parameter", param="model", code="missing")
    if not isinstance(model, str) or not model:
        raise _invalid_type("model", "a non-empty string", model)
    return model


def _check_messages(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if messages is None:
        raise BadRequest(
            "Missing required parameter: 'messages'.", param="messages", code="missing"
        )
    if not isinstance(messages, list):
        raise _invalid_type("messages", "an array", messages)
    if not messages:
        raise BadRequest(
            "Invalid 'messages': empty array. Expected an array with minimum length 1.",
            param="messages",
            code="empty_array",
        )
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _invalid_type(param, "an object", message)
        role = message.get("role")
        if role not in _ROLES:
            raise BadRequest(
                f"Invalid value for '{param}.role': expected one of {', '.join(sorted(_ROLES))}.",
                param=f"{param}.role",
                code="invalid_value",
            )


def _check_input(body: dict[str, Any], name: str) -> None:
    value = body.get(name)
    if value is None:
        raise BadRequest(f"Missing required parameter: '{name}'.", param=name, code="missing")
    if not isinstance(value, str | list):
        raise _invalid_type(name, "a string or an array", value)
    if isinstance(value, list) and not value:
        raise BadRequest(
            f"Invalid '{name}': empty array. Expected an array with minimum length 1.",
            param=name,
            code="empty_array",
        )


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
    if not isinstance(options, dict):
        raise _invalid_type("stream_options", "an object", options)
    return _check_type(options, "include_usage", bool, "stream_options.") or False


def _check_type(body: dict[str, Any], name: str, kind: type, prefix: str = "") -> Any:
    value = body.get(name)
    if value is not None and type(value) is not kind:
        raise _invalid_type(prefix + name, _TYPE_NAMES.get(kind, kind.__name__), value)
    return value


def _check_int(body: dict[str, Any], name: str, low: int, high: int) -> None:
    value = body.get(name)
    if value is None:
        return
    if type(value) is not int:
        raise _invalid_type(name, "an integer", value)
    _check_range(name, value, low, high, "integer")


def _check_number(body: dict[str, Any], name: str, low: float, high: float) -> None:
    value = body.get(name)
    if value is None:
        return
    if type(value) not in (int, float):
        raise _invalid_type(name, "a number", value)
    _check_range(name, value, low, high, "decimal")


def _check_range(name: str, value: float, low: float, high: float, kind: str) -> None:
    if value < low:
        raise BadRequest(
            f"Invalid '{name}': {kind} below minimum value. "
            f"Expected a value >= {low}, but got {value} instead.",
            param=name,
            code=f"{kind}_below_min_value",
        )
    if value > high:
        raise BadRequest(
            f"Invalid '{name}': {kind} above maximum value. "
            f"Expected a value <= {high}, but got {value} instead.",
            param=name,
            code=f"{kind}_above_max_value",
        )


def _invalid_type(param: str, expected: str, value: object) -> BadRequest:
    got = "null" if value is None else _TYPE_NAMES.get(type(value), type(value).__name__)
    if isinstance(value, list):
        got = "an array"
    elif isinstance(value, dict):
        got = "an object"
    return BadRequest(
        f"Invalid type for '{param}': expected {expected}, but got {got} instead.",
        param=param,
        code="invalid_type",
    )
