"""Read a policy file: YAML -> Policy, every problem named by file, line and key path."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import pydantic
from pydantic_core import ErrorDetails

from proxy.policy.hints import pydantic_problem, without_echoes
from proxy.policy.model import Budget, Policy, Tenant
from proxy.policy.problems import KeyPath, PolicyError, Problem, by_line, dotted, line_of
from proxy.policy.yamlfile import decode_policy, read_yaml
from proxy.storage.redis.url import is_redis_url

__all__ = [
    "MAX_POLICY_BYTES",
    "PolicyError",
    "Problem",
    "decode_policy",
    "load_policy",
    "parse_policy",
    "read_policy_bytes",
    "read_policy_stream",
]

MAX_POLICY_BYTES = 16 << 20
"""The largest policy file read: a policy of 10,000 tenants is a few MB. Past it (`/dev/zero`, a
runaway generator) the file is refused, not read until memory runs out."""


def load_policy(
    path: str | Path, environ: Mapping[str, str] | None = None, *, keys_needed: bool = True
) -> Policy:
    """Parse the policy file at `path`; `${ENV}` references resolve against `environ`.

    `keys_needed=False` is for readers of the policy that serve nobody (`tokenweir report`): a
    client key whose variable is unset then matches no key instead of being an error."""
    text = decode_policy(read_policy_bytes(path), str(path))
    return parse_policy(text, file=str(path), environ=environ, keys_needed=keys_needed)


def read_policy_bytes(path: str | Path) -> bytes:
    """The file's bytes, read once (a FIFO, `--config <(...)`, has no size to ask first), or a
    PolicyError if it cannot be read or holds more than MAX_POLICY_BYTES. Every reader of a
    policy file reads it here (the watcher's version too: proxy/filewatch.py)."""
    try:
        stream = Path(path).open("rb")
    except OSError as exc:
        raise _unreadable(str(path), exc) from exc
    with stream:
        return read_policy_stream(stream, str(path))


def read_policy_stream(stream: BinaryIO, file: str) -> bytes:
    """`read_policy_bytes` for a stream already open (`policy check -`: standard input)."""
    try:
        data = stream.read(MAX_POLICY_BYTES + 1)
    except OSError as exc:  # a directory fails here, not at its opening
        raise _unreadable(file, exc) from exc
    if len(data) > MAX_POLICY_BYTES:
        message = f"more than {MAX_POLICY_BYTES >> 20} MiB, the most a policy file may hold"
        raise PolicyError([Problem(file, 0, "", message)])
    return data


def _unreadable(file: str, exc: OSError) -> PolicyError:
    return PolicyError([Problem(file, 0, "", f"cannot read the file: {exc.strerror}")])


def parse_policy(
    text: str,
    *,
    file: str = "<policy>",
    environ: Mapping[str, str] | None = None,
    keys_needed: bool = True,
) -> Policy:
    data, lines, words = read_yaml(text, file)
    if data is None:
        empty = "the policy file is empty: it needs backends:, models: and tenants:"
        raise PolicyError([Problem(file, 1, "", empty)])
    if not isinstance(data, dict):
        raise PolicyError([Problem(file, 1, "", "the policy file must be a YAML mapping")])
    context = {"environ": os.environ if environ is None else environ, "keys_needed": keys_needed}
    try:
        policy = Policy.model_validate(data, context=context)
    except pydantic.ValidationError as exc:
        errors = without_echoes(exc.errors())
        found = [pydantic_problem(file, lines, words, err) for err in errors]
        pruned = _pruned_policy(data, errors, context)
        if pruned is not None:
            policy, removed = pruned
            found += _reference_problems(file, lines, policy, removed)
        raise PolicyError(by_line(found)) from None
    dangling = _reference_problems(file, lines, policy, {})
    if dangling:
        raise PolicyError(dangling)
    return policy


# Rounds of pruning: an invalid value removed may leave its object missing a required key.
_PRUNE_ROUNDS = 3


def _pruned_policy(
    data: dict[str, Any], errors: list[ErrorDetails], context: dict[str, Any]
) -> tuple[Policy, dict[KeyPath, list[int]]] | None:
    """The policy without the keys and items pydantic refused, so the cross-reference checks
    can run on the rest; with what was removed: list items by list path (original indices),
    keys as paths without items."""
    pruned = copy.deepcopy(data)
    removed: dict[KeyPath, list[int]] = {}
    for _ in range(_PRUNE_ROUNDS):
        for error in errors:
            loc = tuple(p for p in error["loc"] if p != "[key]")
            _remove(pruned, loc[:-1] if error["type"] == "missing" else loc, removed)
        try:
            return Policy.model_validate(pruned, context=context), removed
        except pydantic.ValidationError as exc:
            errors = exc.errors()
    return None


def _remove(data: object, loc: KeyPath, removed: dict[KeyPath, list[int]]) -> None:
    """Delete the key or list item at `loc` (given in original indices) if it is there."""
    if not loc:
        return
    parent: Any = data
    for depth, part in enumerate(loc[:-1]):
        if isinstance(part, int):
            part = _current_index(part, removed.get(loc[:depth], []))
        try:
            parent = parent[part]
        except (KeyError, IndexError, TypeError):
            return
    last = loc[-1]
    if isinstance(parent, dict) and last in parent:
        del parent[last]
        removed.setdefault(loc, [])  # a key: no items, but known to be gone
    elif isinstance(parent, list) and isinstance(last, int):
        gone = removed.setdefault(loc[:-1], [])
        if last not in gone and 0 <= _current_index(last, gone) < len(parent):
            del parent[_current_index(last, gone)]
            gone.append(last)


def _current_index(original: int, gone: list[int]) -> int:
    return original - sum(1 for g in gone if g < original)


def _original_path(path: KeyPath, removed: dict[KeyPath, list[int]]) -> KeyPath:
    out: list[str | int] = []
    for part in path:
        if isinstance(part, int):
            gone = sorted(removed.get(tuple(out), []))
            for g in gone:  # the n-th surviving item is the n-th index not removed
                if g <= part:
                    part += 1
        out.append(part)
    return tuple(out)


def _reference_problems(
    file: str, lines: dict[KeyPath, int], policy: Policy, removed: dict[KeyPath, list[int]]
) -> list[Problem]:
    found = []
    for path, message in _dangling_references(policy):
        if removed.get(("backends",)) and _about_a_backend(path):
            continue  # a refused backend serves nothing here, but it may be meant to
        if ("storage",) in removed and path == ("ledger",):
            continue  # the refused storage may be the Redis it needs
        original = _original_path(path, removed)
        found.append(Problem(file, line_of(lines, original), dotted(original), message))
    return by_line(found)


def _about_a_backend(path: KeyPath) -> bool:
    """A model no backend serves, or a verifier's backend not found: a refused backend may be
    the one meant."""
    return (path[0] == "models" and len(path) == 2) or path[-2:] == ("verifier", "backend")


def _dangling_references(policy: Policy) -> list[tuple[KeyPath, str]]:
    found: list[tuple[KeyPath, str]] = []
    if policy.ledger == "redis" and not is_redis_url(policy.storage):
        found.append((("ledger",), "ledger: redis needs a Redis storage (redis://...)"))
    served = {m for b in policy.backends for m in b.models}
    names: set[str] = set()
    for i, backend in enumerate(policy.backends):
        if backend.name in names:
            found.append((("backends", i, "name"), f"duplicate backend name {backend.name!r}"))
        names.add(backend.name)
        for j, model in enumerate(backend.models):
            if model not in policy.models:
                found.append((("backends", i, "models", j), _unknown_model(model)))
    found += _model_problems(policy, served)
    found += _embedder_problems(policy, served)
    owners: dict[str, str] = {}
    for tenant_name, tenant in policy.tenants.items():
        for j, model in enumerate(tenant.models):
            if model not in policy.models:
                found.append((("tenants", tenant_name, "models", j), _unknown_model(model)))
        verifier = tenant.cache.verifier
        if verifier is not None and verifier.backend not in names:
            at: KeyPath = ("tenants", tenant_name, "cache", "verifier", "backend")
            found.append((at, f"no backend named {verifier.backend!r}"))
        reached = _reached_models(policy, tenant)
        for model in tenant.limits.per_model:
            if model not in reached:
                where: KeyPath = ("tenants", tenant_name, "limits", "per_model", model)
                found.append((where, _UNREACHED.format(model=model)))
        for k, rule in enumerate(tenant.degrade):
            if rule.then.model is not None and rule.then.model not in policy.models:
                path: KeyPath = ("tenants", tenant_name, "degrade", k, "then", "model")
                found.append((path, _unknown_model(rule.then.model)))
            if rule.when.budget_used_above is not None and not _has_quota(tenant.budget):
                path = ("tenants", tenant_name, "degrade", k, "when", "budget_used_above")
                found.append((path, _NO_QUOTA))
        for j, key in enumerate(tenant.api_keys):
            other = owners.setdefault(key, tenant_name)
            if other != tenant_name:
                path = ("tenants", tenant_name, "api_keys", j)
                found.append((path, f"this key also belongs to tenant {other!r}"))
    return found


def _reached_models(policy: Policy, tenant: Tenant) -> set[str]:
    """The models that may serve a tenant's request, whose `per_model` limits then admit it: its
    own, those its degradation rules send requests to, and the fallback models of both."""
    asked = set(tenant.models) | {r.then.model for r in tenant.degrade if r.then.model}
    specs = policy.models
    return asked | {f for m in asked if m in specs for f in specs[m].fallback_models}


def _model_problems(policy: Policy, served: set[str]) -> list[tuple[KeyPath, str]]:
    """Models no backend serves, and fallback models that are not other models of the file."""
    found: list[tuple[KeyPath, str]] = []
    for model, spec in policy.models.items():
        if model not in served:
            found.append((("models", model), f"model {model!r} has no backend serving it"))
        for j, fallback in enumerate(spec.fallback_models):
            if fallback == model or fallback not in policy.models:
                why = f"{fallback!r} is not another model here"
                found.append((("models", model, "fallback_models", j), why))
    return found


def _embedder_problems(policy: Policy, served: set[str]) -> list[tuple[KeyPath, str]]:
    found: list[tuple[KeyPath, str]] = []
    embedder = policy.embedder
    if embedder is not None and embedder.model is not None and embedder.model not in served:
        found.append((("embedder", "model"), f"no backend serves model {embedder.model!r}"))
    return found


_UNREACHED = (
    "no request of the tenant reaches model {model!r} (not one of its models, a model its "
    "degradation rules send requests to, nor a fallback model of either)"
)
_NO_QUOTA = (
    "the tenant has no quota to measure (budget: tokens_per_day, tokens_per_month, usd_per_day "
    "or usd_per_month), so the rule would never fire"
)


def _has_quota(budget: Budget) -> bool:
    quotas = (budget.tokens_per_day, budget.tokens_per_month, budget.usd_per_day)
    return any(q is not None for q in (*quotas, budget.usd_per_month))


def _unknown_model(model: str) -> str:
    return f"unknown model {model!r} (declare it under models:)"
