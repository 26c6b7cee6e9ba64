"""Anthropic's side of the boundary: its key header, and its error shape and statuses.

The stages raise the gateway's errors and render them OpenAI's way; `AnthropicErrors` wraps the
ASGI `send` of a Messages request and rewrites those answers (a whole error, or a stream's
closing error event) into `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Final

import orjson
from starlette.datastructures import QueryParams
from starlette.types import Message, Scope, Send

from proxy.errors import BadRequest
from proxy.upstream.rejection import error_fields

__all__ = ["AnthropicErrors", "anthropic_error", "anthropic_models", "with_api_key"]

_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_KNOWN_TYPES: Final = frozenset(_TYPES.values())
# Anthropic says 529 where the gateway says 503 (overloaded: retry shortly).
_STATUSES: Final = {503: 529}
_STREAM_ERROR: Final = b'data: {"error"'


def with_api_key(scope: Scope) -> Scope:
    """The scope with each `x-api-key` presented as a bearer key too. Beside an Authorization
    that names another key it makes the request's keys ambiguous, refused by
    `authorization_of` (proxy/stages/auth.py), not decided by which header wins."""
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    keys = [(b"authorization", b"Bearer " + v) for name, v in headers if name == b"x-api-key" and v]
    if not keys:
        return scope
    return {**scope, "headers": [*headers, *keys]}


def anthropic_models(
    models: Sequence[str], wanted: str | None, created: int, query: QueryParams
) -> dict[str, object]:
    """Anthropic's `ModelInfo` for `wanted`, or a page of `models`: `limit` of them (1 to 1,000,
    20 when not given) after `after_id` or before `before_id`."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))
    if wanted is not None:
        return _model_info(wanted, stamp)
    limit_text = query.get("limit", "20")
    if not (limit_text.isascii() and limit_text.isdigit() and 1 <= int(limit_text) <= 1000):
        raise BadRequest("limit must be an integer from 1 to 1000", param="limit")
    limit, start, end = int(limit_text), 0, len(models)
    for param in ("after_id", "before_id"):
        cursor = query.get(param)
        if cursor is None:
            continue
        if cursor not in models:
            raise BadRequest(f"{param} {cursor!r} is not a model of this key", param=param)
        if param == "after_id":
            start = models.index(cursor) + 1
        else:
            end = models.index(cursor)
    if "before_id" in query and "after_id" not in query:
        start = max(start, end - limit)
    page = list(models[start:end][:limit])
    backwards = "before_id" in query and "after_id" not in query
    return {
        "data": [_model_info(model, stamp) for model in page],
        "has_more": start > 0 if backwards else start + len(page) < end,
        "first_id": page[0] if page else None,
        "last_id": page[-1] if page else None,
    }


def _model_info(model: str, created_at: str) -> dict[str, object]:
    return {"type": "model", "id": model, "display_name": model, "created_at": created_at}


def anthropic_error(status: int, openai_body: bytes) -> tuple[int, bytes]:
    """Anthropic's status and body for a gateway error answer (OpenAI-shaped `openai_body`)."""
    error = error_fields(openai_body)
    message = error.get("message")
    if not isinstance(message, str) or not message:
        message = f"The gateway answered {status}."
    status = _STATUSES.get(status, status)
    given = error.get("type")
    kind = _TYPES.get(status) or (given if given in _KNOWN_TYPES else None)
    if kind is None:
        kind = "api_error" if status >= 500 else "invalid_request_error"
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return status, orjson.dumps(body)


class AnthropicErrors:
    """`send` for a Messages request: errors leave in Anthropic's shape, and every answer says
    its request id as Anthropic's `request-id` too (what Anthropic's SDKs read into
    `_request_id` and their errors' messages); all else unchanged."""

    __slots__ = ("_chunks", "_held", "_request_id", "_send", "_stream")

    def __init__(self, send: Send, request_id: str = "") -> None:
        self._send = send
        self._request_id = request_id.encode()
        self._held: Message | None = None
        self._chunks: list[bytes] = []
        self._stream = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            if self._request_id:
                headers = [*message.get("headers", ()), (b"request-id", self._request_id)]
                message = {**message, "headers": headers}
            if message["status"] >= 400:
                self._held = message  # sent with the body, once it is rewritten
                return
            content_type = dict(message.get("headers", ())).get(b"content-type", b"")
            self._stream = content_type.startswith(b"text/event-stream")
        elif message["type"] == "http.response.body":
            if self._held is not None:
                await self._error(message)
                return
            if self._stream and not message.get("more_body", False):
                message = self._closing_event(message)
        await self._send(message)

    async def _error(self, message: Message) -> None:
        self._chunks.append(message.get("body", b""))
        if message.get("more_body", False) or self._held is None:
            return
        start, self._held = self._held, None
        status, body = anthropic_error(start["status"], b"".join(self._chunks))
        headers = [
            (name, value)
            for name, value in start.get("headers", ())
            if name not in (b"content-length", b"content-type")
        ]
        headers += [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await self._send({**start, "status": status, "headers": headers})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    def _closing_event(self, message: Message) -> Message:
        """A stream cut by an error ends in an OpenAI-shaped `data:` event: Anthropic's clients
        read only named events, so it becomes an `event: error`."""
        body: bytes = message.get("body", b"")
        at = body.find(_STREAM_ERROR)
        if at < 0:
            return message
        payload = body[at + len(b"data: ") :].strip()
        _, rewritten = anthropic_error(500, payload)
        event = b"event: error\ndata: " + rewritten + b"\n\n"
        return {**message, "body": body[:at] + event}
