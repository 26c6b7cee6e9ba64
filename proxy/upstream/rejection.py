"""A backend's error answer as the gateway passes it on: its OpenAI fields as bounded strings, its
`Retry-After` (seconds or an HTTP-date) parsed, garbage dropped, the wait clamped."""

from __future__ import annotations

import datetime
import email.utils
import math
import re
import time
from collections.abc import Callable
from typing import Any, Final

import httpx
import orjson

from proxy.errors import GatewayError, UpstreamError, UpstreamUnavailable
from proxy.jsontext import json_text
from proxy.policy.model import Backend

__all__ = [
    "MAX_RETRY_AFTER_S",
    "UpstreamRejected",
    "error_fields",
    "field_text",
    "retry_after_s",
    "status_error",
]

# A backend asking for a longer wait is still asked again within the hour.
MAX_RETRY_AFTER_S: Final = 3600
# An error field longer than this is cut: it is shown to a person, not parsed.
_MAX_FIELD_CHARS: Final = 2000
# What stands for the gateway's key to the backend in an error message that echoed it.
_KEY_SHOWN: Final = "[the gateway's backend key]"
# A backend key shorter than this is a placeholder, not a secret, and is not cut from messages.
_MIN_KEY_CHARS: Final = 8
# A backend unavailable for now: 503, or Anthropic's 529 (overloaded), which backends in front of
# Anthropic's API pass on.
_OVERLOADED: Final = (503, 529)
# The fields of an error object the gateway passes on.
_FIELDS: Final = ("message", "type", "param", "code")
# delay-seconds, leniently: a fraction or an exponent is read too (and rounded up); no sign.
_SECONDS: Final = re.compile(r"\s*\d+(?:\.\d*)?(?:[eE]\+?\d+)?\s*")


class UpstreamRejected(GatewayError):
    """A backend's own 4xx answer, passed on to the client with its status and OpenAI fields."""

    def __init__(
        self, status: int, backend_error: dict[str, Any], retry_after_s: float | None = None
    ) -> None:
        super().__init__(
            field_text(backend_error.get("message")) or f"the backend answered {status}",
            param=field_text(backend_error.get("param")),
            code=field_text(backend_error.get("code")),
            retry_after_s=retry_after_s,
        )
        self.status = status
        self.type = field_text(backend_error.get("type")) or "invalid_request_error"


def status_error(backend: Backend, response: httpx.Response, raw: bytes) -> GatewayError:
    """The error a backend's non-2xx answer (its first bytes in `raw`) becomes. The gateway's
    key for the backend, should the answer echo it, is cut from every field passed on."""
    status = response.status_code
    key = backend.api_key.get_secret_value() if backend.api_key is not None else ""
    if len(key) < _MIN_KEY_CHARS:
        key = ""  # a placeholder key (vLLM's "EMPTY"): cutting it would garble the message
    backend_error = _without_key(error_fields(raw), key)
    detail = field_text(backend_error.get("message")) or _cut(raw.decode("utf-8", "replace"), key)
    if status in (401, 403):
        return UpstreamError(f"backend {backend.name!r} rejected the gateway's credentials")
    if 400 <= status < 500:
        if status != 429:
            return UpstreamRejected(status, backend_error)
        # Through the constructor: a wait over a minute also says `x-should-retry: false`.
        wait_s = retry_after_s(response.headers.get("retry-after")) or 1
        return UpstreamRejected(status, backend_error, retry_after_s=wait_s)
    if status in _OVERLOADED:
        return UpstreamUnavailable(
            f"backend {backend.name!r} is unavailable: {detail}",
            retry_after_s=retry_after_s(response.headers.get("retry-after")) or 1,
        )
    return UpstreamError(f"backend {backend.name!r} answered {status}: {detail}")


def _without_key(backend_error: dict[str, Any], key: str) -> dict[str, Any]:
    """The error's fields, as text, with `key` replaced wherever it appears (a backend that
    echoes the Authorization it was sent: "Malformed API Key passed in: Bearer sk-...")."""
    if not key:
        return backend_error
    fields: dict[str, Any] = {}
    for name, value in backend_error.items():
        text = value if isinstance(value, str) or value is None else json_text(value)
        fields[name] = text.replace(key, _KEY_SHOWN) if text is not None else None
    return fields


def _cut(text: str, key: str) -> str:
    """An error body's first 200 characters, with `key` replaced before the cut (which could
    leave a part of it)."""
    return (text.replace(key, _KEY_SHOWN) if key else text)[:200]


def field_text(value: object) -> str | None:
    """An error field as OpenAI's clients expect it, a string: JSON text for anything else
    (a `code` object stays readable, never a Python repr); None and "" are absent."""
    if value is None or value == "":
        return None
    text = value if isinstance(value, str) else json_text(value)  # nested past 254 levels too
    return text if len(text) <= _MAX_FIELD_CHARS else text[:_MAX_FIELD_CHARS] + "..."


def retry_after_s(value: str | None, wall: Callable[[], float] = time.time) -> int | None:
    """Whole seconds to wait, 0 to MAX_RETRY_AFTER_S, from delay-seconds or an HTTP-date; None
    for anything else (nan, inf, negative numbers, text)."""
    if not value:
        return None
    if _SECONDS.fullmatch(value):
        seconds = float(value)  # 1e400 is inf here: a very long wait, clamped like 1e300
    else:
        until = _seconds_until(value, wall())
        if until is None:
            return None
        seconds = until
    return math.ceil(min(float(MAX_RETRY_AFTER_S), max(0.0, seconds)))


def _seconds_until(http_date: str, now: float) -> float | None:
    try:
        when = email.utils.parsedate_to_datetime(http_date)
        if when.tzinfo is None:  # "-0000": a date in UTC without a stated source
            when = when.replace(tzinfo=datetime.UTC)
        return when.timestamp() - now
    except (TypeError, ValueError, OverflowError):
        return None


def error_fields(raw: bytes) -> dict[str, Any]:
    """The `error` object of an error body (a bare string as its message), or the body itself
    where it is the error object (vLLM's and SGLang's `{"object": "error", "message", "type",
    "param", "code"}`), or FastAPI's `detail` as the message; {} if none."""
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {}
    if not isinstance(parsed, dict):
        return {}
    error = parsed.get("error")
    if isinstance(error, dict):
        return error
    if isinstance(error, str):
        return {"message": error}
    if "message" in parsed:
        return {name: parsed[name] for name in _FIELDS if name in parsed}
    if "detail" in parsed:
        return {"message": parsed["detail"]}
    return {}
