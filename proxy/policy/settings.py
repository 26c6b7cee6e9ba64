"""Settings a policy may take from the environment (`${NAME}`, `${NAME:-default}`), checked as
values a header or a request line can carry, and client keys as stored (hashed)."""

from __future__ import annotations

import re
from collections.abc import Mapping

from pydantic import ValidationInfo

from proxy.policy.units import hash_key

__all__ = ["backend_key", "client_key", "has_control", "optional_setting", "setting"]

# `${NAME}`, or `${NAME:-default}` (the default when NAME is unset or empty, as in a shell).
_ENV_REF = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}$")
_HASHED = re.compile(r"^sha256:[0-9a-f]{64}$")
# What an unset key variable stands for where keys are not needed: no key hashes to it.
_NO_KEY = "sha256:" + "0" * 64


def _environ(info: ValidationInfo) -> Mapping[str, str]:
    context = info.context if isinstance(info.context, Mapping) else {}
    environ = context.get("environ", {})
    return environ if isinstance(environ, Mapping) else {}


def _resolve_env(value: str, info: ValidationInfo) -> str | None:
    """The value of a `${NAME}` or `${NAME:-default}` reference, or None if `value` is not one;
    only an explicit empty default (`${NAME:-}`) may resolve to ""."""
    match = _ENV_REF.match(value)
    if match is None:
        return None
    name, default = match.groups()
    resolved = _environ(info).get(name) or default
    if resolved is None or (not resolved and default is None):
        raise ValueError(f"environment variable {name} is not set or empty")
    if flaw := _unsendable(resolved):
        raise ValueError(f"environment variable {name} {flaw}")
    return resolved


def _unsendable(value: str) -> str | None:
    """What keeps `value` (a key, a URL) from being sent in a header or a request line as it
    is, if anything: an HTTP header cannot carry a newline, and servers strip outer spaces."""
    if value.endswith("\n"):
        return (
            "ends with a newline, which no client or backend can send: set it without one "
            "(a Kubernetes Secret made with echo has one; use printf or echo -n)"
        )
    if value != value.strip():
        return "starts or ends with whitespace, which no client or backend can send"
    if has_control(value):
        return "holds a control character, which no client or backend can send"
    return None


def setting(value: object, info: ValidationInfo) -> object:
    """A setting given literally or as `${ENV}` / `${ENV:-default}`."""
    if isinstance(value, str):
        resolved = _resolve_env(value, info)
        if resolved is None and "${" in value:  # it would be used as written, "${" and all
            raise ValueError(
                "a ${NAME} reference is the whole value (url: ${BACKEND_URL}), not a part of it"
            )
        return value if resolved is None else resolved
    return value


def optional_setting(value: object, info: ValidationInfo) -> object:
    """As `setting`, with "" (`${ENV:-}` and ENV unset) meaning not set."""
    resolved = setting(value, info)
    return None if resolved == "" else resolved


def backend_key(value: object, info: ValidationInfo) -> object:
    """A backend's key, literal or from the environment: what an `authorization` header can
    carry. A character past ASCII (a pasted key's non-breaking space or curly quote) made
    every request to the backend, and /readyz, a 500."""
    resolved = optional_setting(value, info)
    if not isinstance(resolved, str):
        return resolved
    if value == resolved and (flaw := _unsendable(resolved)):  # a reference's is checked
        raise ValueError(f"the key {flaw}")
    for place, char in enumerate(resolved, 1):
        if ord(char) > 0x7E:
            raise ValueError(
                f"the key holds U+{ord(char):04X} (character {place}), which no HTTP header "
                "carries: a key is printable ASCII"
            )
    return resolved


def client_key(value: object, info: ValidationInfo) -> str:
    """A client key as stored: `sha256:<hex>`, or `${ENV}` holding the plain key (hashed here)."""
    if not isinstance(value, str):
        raise ValueError("an API key must be a string: sha256:<hex> or ${ENV_NAME}")
    context = info.context if isinstance(info.context, Mapping) else {}
    if context.get("keys_needed") is False and _ENV_REF.match(value):
        try:
            plain = _resolve_env(value, info)
        except ValueError:
            return _NO_KEY
    else:
        plain = _resolve_env(value, info)
    if plain:
        return hash_key(plain)
    if plain is not None:
        raise ValueError("an API key may not be empty")
    if _HASHED.match(value):
        return value
    raise ValueError(
        "API keys are stored hashed as sha256:<64 lowercase hex> or referenced as ${ENV_NAME}; "
        "hash a key with: tokenweir policy hash-key"
    )


def has_control(text: str) -> bool:
    """A newline or another control character: no header, log line or metric label takes it."""
    return any(ord(char) < 0x20 or ord(char) == 0x7F for char in text)
