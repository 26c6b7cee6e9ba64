"""pydantic's errors as problems an operator can act on: the key meant by a misspelt one, the
word YAML read as a boolean or a number, no echo of an error already reported."""

from __future__ import annotations

import difflib
import types
import typing
from typing import TypeGuard

import pydantic
import yaml
from pydantic_core import ErrorDetails

from proxy.policy.model import Policy
from proxy.policy.problems import KeyPath, Problem, dotted, line_of

__all__ = ["pydantic_problem", "without_echoes"]


def without_echoes(errors: list[ErrorDetails]) -> list[ErrorDetails]:
    """Drop "too short" for a list whose items were already reported as invalid."""
    item_locs = [e["loc"] for e in errors if e["type"] != "too_short"]
    return [
        e
        for e in errors
        if e["type"] != "too_short"
        or not any(loc[: len(e["loc"])] == e["loc"] for loc in item_locs)
    ]


_LIST = "expected a list: [a, b], or one '- item' line each (a single item too: [a])"
_MAPPING = "expected a mapping: {key: value}, or one 'key: value' line each"
_IN_YAML_TERMS = {"tuple_type": _LIST, "dict_type": _MAPPING, "model_type": _MAPPING}


def pydantic_problem(
    file: str, lines: dict[KeyPath, int], words: dict[KeyPath, str], error: ErrorDetails
) -> Problem:
    path: KeyPath = tuple(p for p in error["loc"] if p != "[key]")
    kind = error["type"]
    if kind == "extra_forbidden":
        message = "unknown key" + _did_you_mean(path)
    elif kind == "missing":
        message = "required key is missing"
    elif kind in _IN_YAML_TERMS:  # pydantic says tuple and dictionary, YAML list and mapping
        message = _IN_YAML_TERMS[kind]
    elif kind == "invalid_key":  # where names are fixed, a key YAML read as other than text
        message = "a key must be text"
    elif kind == "too_short" and "ctx" in error:
        least, got = error["ctx"].get("min_length"), error["ctx"].get("actual_length")
        message = f"expected at least {least} item{'s' if least != 1 else ''}, got {got}"
    else:
        message = error["msg"].removeprefix("Value error, ")
    shown = path
    if kind in ("string_type", "literal_error", "invalid_key") and not isinstance(
        error["input"], str
    ):
        is_key = error["loc"][-1] == "[key]" or kind == "invalid_key"
        word = words.get((*path, "[key]") if is_key else path)
        if word is not None:  # YAML 1.1 reads unquoted yes, no, on, off, null and numbers so
            resolved = yaml.safe_load(word)
            kind_read = "null" if resolved is None else str(resolved).lower()
            message += f"; YAML reads {word} unquoted as {kind_read}: write it in quotes, '{word}'"
            shown = (*path[:-1], word) if is_key else path
    return Problem(file, line_of(lines, path), dotted(shown), message)


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
