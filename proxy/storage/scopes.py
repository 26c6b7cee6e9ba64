"""Whose keys a scope's are: the prefix, with its Redis hash tag, that every key of a tenant's or
a backend's quotas and limits begins with, made here and read back here alone."""

from __future__ import annotations

from typing import Literal

__all__ = ["backend_scope", "scope_owner", "tenant_scope"]

_TENANT = "tw:{"
# Not tw:{backend:<name>}, which is also the scope of a tenant named "backend:<name>" (a tenant's
# is tw:{<name>}, and names have no braces): that tenant's lone request took its own slot, then
# found the backend's pool holding it and was refused.
_BACKEND = "tw:backend:{"


def tenant_scope(tenant: str) -> str:
    """A tenant's: its name is the hash tag, so a Redis Cluster keeps its keys on one slot (its
    quotas, limits, cache and runtime keys, which one script call takes together)."""
    return f"{_TENANT}{tenant}}}"


def backend_scope(backend: str) -> str:
    """A backend's own limits, shared by every tenant."""
    return f"{_BACKEND}{backend}}}"


def scope_owner(scope: str) -> tuple[Literal["tenant", "backend"], str] | None:
    """Whose `scope` is, as `tenant_scope` or `backend_scope` made it; None for another (a
    runtime key's own, `<tenant's scope>:key:<id>`)."""
    if scope.startswith(_BACKEND):
        backend = _name_in(scope, _BACKEND)
        return None if backend is None else ("backend", backend)
    tenant = _name_in(scope, _TENANT)
    return None if tenant is None else ("tenant", tenant)


def _name_in(scope: str, prefix: str) -> str | None:
    """The name between `prefix` and the closing brace, if that is all `scope` is."""
    if not scope.startswith(prefix) or not scope.endswith("}"):
        return None
    name = scope[len(prefix) : -1]
    return None if "{" in name or "}" in name else name
