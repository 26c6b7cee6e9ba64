"""Read a policy file: YAML -> Policy, every problem named by file, line and key path."""

from __future__ import annotations

import copy
import difflib
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import pydantic
import yaml
from pydantic_core import ErrorDetails

from proxy.policy.model import Policy
from proxy.storage.redis.url import is_redis_url

__all__ = ["PolicyError", "Problem", "decode_policy", "load_policy", "parse_policy"]

KeyPath = tuple[str | int, ...]


@dataclass(frozen=True, slots=True)
class Problem:
    file: str
    line: int
    path: str
    message: str

    def __str__(self) -> str:
        where = f"{self.path}: " if self.path else ""
        return f"{self.file}:{self.line}: {where}{self.message}"


class PolicyError(ValueError):
    """A policy file that cannot be used; `problems` lists every reason found."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


def load_policy(
    path: str | Path, environ: Mapping[str, str] | None = None, *, keys_needed: bool = True
) -> Policy:
    """Parse the policy file at `path`; `${ENV}` references resolve against `environ`.

    `keys_needed=False` is for readers of the policy that serve nobody (`tokenweir report`): a
    client key whose variable is unset then matches no key instead of being an error."""
    file = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise PolicyError([Problem(file, 0, "", f"cannot read the file: {exc.strerror}")]) from exc
    text = decode_policy(data, file)
    return parse_policy(text, file=file, environ=environ, keys_needed=keys_needed)


def decode_policy(data: bytes, file: str) -> str:
    """A policy file's bytes as text: UTF-8 (a byte order mark allowed), else a PolicyError at
    the first byte that is not, rather than a traceback or a name silently changed."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        byte = data[exc.start : exc.start + 1].hex()
        message = f"byte 0x{byte} is not UTF-8: save the file as UTF-8"
        raise PolicyError([Problem(file, line, "", message)]) from None


def parse_policy(
    text: str,
    *,
    file: str = "<policy>",
    environ: Mapping[str, str] | None = None,
    keys_needed: bool = True,
) -> Policy:
    data, lines, words = _read_yaml(text, file)
    if not isinstance(data, dict):
        raise PolicyError([Problem(file, 1, "", "the policy file must be a YAML mapping")])
    context = {"environ": os.environ if environ is None else environ, "keys_needed": keys_needed}
    try:
        policy = Policy.model_validate(data, context=context)
    except pydantic.ValidationError as exc:
        errors = _without_echoes(exc.errors())
        found = [_problem(file, lines, words, err) for err in errors]
        pruned = _pruned_policy(data, errors, context)
        if pruned is not None:
            policy, removed = pruned
            found += _reference_problems(file, lines, policy, removed)
        raise PolicyError(_by_line(found)) from None
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
    can run on the rest; with the list items removed (by list path, original indices)."""
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
        if removed.get(("backends",)) and path[0] == "models":
            continue  # a refused backend serves nothing here, but it may be meant to
        original = _original_path(path, removed)
        found.append(Problem(file, _line_of(lines, original), _dotted(original), message))
    return _by_line(found)


def _by_line(problems: list[Problem]) -> list[Problem]:
    return sorted(problems, key=lambda p: (p.line, p.path))


def _read_yaml(text: str, file: str) -> tuple[object, dict[KeyPath, int], dict[KeyPath, str]]:
    """The document, the line of each key and item, and the unquoted words YAML read as
    something other than text (`off` as false), by path."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, {}, {}
        index = _LineIndex(file)
        index.walk(node, (), ())
        return loader.construct_document(node), index.lines, index.words
    except yaml.MarkedYAMLError as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark else 0
        raise PolicyError([Problem(file, line, "", f"invalid YAML: {exc.problem}")]) from None
    except yaml.YAMLError as exc:
        raise PolicyError([Problem(file, 0, "", f"invalid YAML: {exc}")]) from None
    except RecursionError:  # PyYAML reads nested collections recursively
        line = loader.get_mark().line + 1
        raise PolicyError([Problem(file, line, "", _TOO_DEEP)]) from None
    finally:
        loader.dispose()


# A policy is a few levels deep; a value nested deeper is a mistake (or an attack on the reader).
MAX_DEPTH = 32
# Values aliases may add by repeating their anchors': this many, or ALIAS_FACTOR times the
# values written in the file. Rules shared by every tenant fit; a "billion laughs" (aliases of
# aliases, 9 ** 9 values from a few lines) does not, nor does it in a file of many MB.
MAX_ALIASED_VALUES = 100_000
ALIAS_FACTOR = 10
# What YAML 1.1 reads an unquoted word as, other than text: `off` is false, `~` null, `1.5` a float.
_WORDS = frozenset(f"tag:yaml.org,2002:{kind}" for kind in ("bool", "null", "int", "float"))
_TOO_DEEP = (
    f"values are nested more than {MAX_DEPTH} levels deep (or an alias is inside its own anchor)"
)
_ALIAS_BOMB = (
    f"aliases here repeat more values than the file holds {ALIAS_FACTOR} times over (and more "
    f"than {MAX_ALIASED_VALUES:,}): write them out"
)


class _LineIndex:
    """The line of every key and item; duplicate keys are errors, not last-one-wins. Values
    nested too deeply (an alias inside its own anchor nests without end) and aliases that
    repeat too many values are errors too: what reads the document next would not end."""

    __slots__ = ("file", "lines", "seen", "visits", "words")

    def __init__(self, file: str) -> None:
        self.file = file
        self.lines: dict[KeyPath, int] = {}
        self.words: dict[KeyPath, str] = {}
        self.seen: set[int] = set()
        self.visits = 0

    def walk(self, node: yaml.Node, path: KeyPath, site: KeyPath) -> None:
        """`site`: where the alias `node` came from is used (the nearest value not repeated)."""
        line = self.lines.setdefault(path, node.start_mark.line + 1)
        if id(node) not in self.seen:
            site = path
            self.seen.add(id(node))
        self.visits += 1
        if len(path) > MAX_DEPTH:
            raise PolicyError([Problem(self.file, line, _dotted(path[:MAX_DEPTH]), _TOO_DEEP)])
        if self.visits - len(self.seen) > max(MAX_ALIASED_VALUES, ALIAS_FACTOR * len(self.seen)):
            raise PolicyError([Problem(self.file, self.lines[site], _dotted(site), _ALIAS_BOMB)])
        if isinstance(node, yaml.MappingNode):
            keys: set[str] = set()
            for key_node, value_node in node.value:
                key = str(key_node.value)
                child = (*path, key)
                if key in keys:
                    line = key_node.start_mark.line + 1
                    raise PolicyError([Problem(self.file, line, _dotted(child), "duplicate key")])
                keys.add(key)
                self.lines[child] = key_node.start_mark.line + 1
                if _is_word(key_node):  # recorded as pydantic names it too
                    self.lines[(*path, _as_loc(key))] = self.lines[child]
                    self.words[(*path, _as_loc(key), "[key]")] = key
                self.walk(value_node, child, site)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                self.walk(item, (*path, index), site)
        elif _is_word(node):
            self.words[path] = str(node.value)


def _is_word(node: yaml.Node) -> bool:
    """An unquoted scalar YAML reads as other than text."""
    return isinstance(node, yaml.ScalarNode) and node.tag in _WORDS and node.style is None


def _without_echoes(errors: list[ErrorDetails]) -> list[ErrorDetails]:
    """Drop "too short" for a list whose items were already reported as invalid."""
    item_locs = [e["loc"] for e in errors if e["type"] != "too_short"]
    return [
        e
        for e in errors
        if e["type"] != "too_short"
        or not any(loc[: len(e["loc"])] == e["loc"] for loc in item_locs)
    ]


def _problem(
    file: str, lines: dict[KeyPath, int], words: dict[KeyPath, str], error: ErrorDetails
) -> Problem:
    path: KeyPath = tuple(p for p in error["loc"] if p != "[key]")
    kind = error["type"]
    if kind == "extra_forbidden":
        message = "unknown key" + _did_you_mean(path)
    elif kind == "missing":
        message = "required key is missing"
    else:
        message = error["msg"].removeprefix("Value error, ")
    shown = path
    if kind in ("string_type", "literal_error") and not isinstance(error["input"], str):
        is_key = error["loc"][-1] == "[key]"
        word = words.get((*path, "[key]") if is_key else path)
        if word is not None:  # YAML 1.1 reads unquoted yes, no, on, off, null and numbers so
            resolved = yaml.safe_load(word)
            kind_read = "null" if resolved is None else str(resolved).lower()
            message += f"; YAML reads {word} unquoted as {kind_read}: write it in quotes, '{word}'"
            shown = (*path[:-1], word) if is_key else path
    return Problem(file, _line_of(lines, path), _dotted(shown), message)


def _did_you_mean(path: KeyPath) -> str:
    """The key meant by a misspelt one, from the keys its place takes (`max_ouput_tokens`:
    max_output_tokens), if one is close."""
    known = _keys_at(Policy, path[:-1])
    close = difflib.get_close_matches(str(path[-1]), known, n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


def _keys_at(shape: object, path: KeyPath) -> list[str]:
    """The keys the policy takes at `path` (a mapping's place), through models, dicts, lists
    and optional values; [] where it takes none or any."""
    for part in path:
        shape = _inner(shape, part)
    shape = _inner(shape, None)
    return list(shape.model_fields) if _is_model(shape) else []


def _is_model(shape: object) -> TypeGuard[type[pydantic.BaseModel]]:
    return isinstance(shape, type) and issubclass(shape, pydantic.BaseModel)


def _inner(shape: object, part: str | int | None) -> object:
    """What `shape` holds at `part` (a key or an index), or, with None, its model if it is an
    optional one."""
    args = typing.get_args(shape)
    origin = typing.get_origin(shape)
    if origin is typing.Annotated:
        return _inner(args[0], part)
    if origin in (typing.Union, types.UnionType):
        models = [a for a in args if _is_model(_inner(a, None))]
        return _inner(models[0], part) if len(models) == 1 else None
    if part is None:
        return shape
    if _is_model(shape):
        field = shape.model_fields.get(str(part))
        return field.annotation if field is not None else None
    if origin is dict and len(args) == 2:
        return args[1]
    if origin is tuple and args:
        return args[0]
    return None


def _as_loc(word: str) -> str | int:
    """How pydantic names a mapping key that YAML read as other than text (`yes` as true)."""
    value = yaml.safe_load(word)
    return int(value) if isinstance(value, bool | int) else str(value)


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
    for model in policy.models:
        if model not in served:
            found.append((("models", model), f"model {model!r} has no backend serving it"))
    found += _embedder_problems(policy, served)
    owners: dict[str, str] = {}
    for tenant_name, tenant in policy.tenants.items():
        for j, model in enumerate(tenant.models):
            if model not in policy.models:
                found.append((("tenants", tenant_name, "models", j), _unknown_model(model)))
        for model in tenant.limits.per_model:
            if model not in tenant.models:
                where: KeyPath = ("tenants", tenant_name, "limits", "per_model", model)
                found.append((where, f"the tenant may not use model {model!r}"))
        for k, rule in enumerate(tenant.degrade):
            if rule.then.model is not None and rule.then.model not in policy.models:
                path: KeyPath = ("tenants", tenant_name, "degrade", k, "then", "model")
                found.append((path, _unknown_model(rule.then.model)))
        for j, key in enumerate(tenant.api_keys):
            other = owners.setdefault(key, tenant_name)
            if other != tenant_name:
                path = ("tenants", tenant_name, "api_keys", j)
                found.append((path, f"this key also belongs to tenant {other!r}"))
    return found


def _embedder_problems(policy: Policy, served: set[str]) -> list[tuple[KeyPath, str]]:
    found: list[tuple[KeyPath, str]] = []
    embedder = policy.embedder
    if embedder is not None and embedder.model is not None and embedder.model not in served:
        found.append((("embedder", "model"), f"no backend serves model {embedder.model!r}"))
    return found


def _unknown_model(model: str) -> str:
    return f"unknown model {model!r} (declare it under models:)"


def _line_of(lines: dict[KeyPath, int], path: KeyPath) -> int:
    while path and path not in lines:
        path = path[:-1]
    return lines.get(path, 1)


def _dotted(path: KeyPath) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
