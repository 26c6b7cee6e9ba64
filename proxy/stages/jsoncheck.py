"""Checks of a JSON value against a small schema, each failure a 400 naming the field as OpenAI
does (`messages[0].content[1].text`) with OpenAI's message and code.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import TypeAlias

from proxy.errors import BadRequest

__all__ = [
    "Check",
    "an_object",
    "array_of",
    "boolean",
    "by_type",
    "empty_array",
    "fields",
    "integer",
    "invalid_type",
    "missing",
    "number",
    "one_of",
    "string",
    "unsupported",
    "values_of",
]

Check: TypeAlias = Callable[[object, str], None]
"""Raises BadRequest naming `param` unless the value (never an omitted field) fits."""

_JSON_NAMES: dict[type, str] = {
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "an array",
    dict: "an object",
    type(None): "null",
}


def invalid_type(param: str, expected: str, value: object) -> BadRequest:
    got = _JSON_NAMES.get(type(value), type(value).__name__)
    return BadRequest(
        f"Invalid type for '{param}': expected {expected}, but got {got} instead.",
        param=param,
        code="invalid_type",
    )


def empty_array(param: str) -> BadRequest:
    return BadRequest(
        f"Invalid '{param}': empty array. Expected an array with minimum length 1.",
        param=param,
        code="empty_array",
    )


def missing(param: str) -> BadRequest:
    return BadRequest(f"Missing required parameter: '{param}'.", param=param, code="missing")


def unsupported(instead: str) -> Check:
    """A field OpenAI refuses on this route, whatever its value; `instead` names the one to use."""

    def check(value: object, param: str) -> None:
        raise BadRequest(
            f"Unsupported parameter: '{param}' is not supported with this endpoint. "
            f"Use '{instead}' instead.",
            param=param,
            code="unsupported_parameter",
        )

    return check


def string(value: object, param: str) -> None:
    if type(value) is not str:
        raise invalid_type(param, "a string", value)


def boolean(value: object, param: str) -> None:
    if type(value) is not bool:
        raise invalid_type(param, "a boolean", value)


def an_object(value: object, param: str) -> None:
    """Any JSON object: its insides are the backend's to judge."""
    if type(value) is not dict:
        raise invalid_type(param, "an object", value)


def integer(low: int, high: int) -> Check:
    def check(value: object, param: str) -> None:
        if type(value) is not int:
            raise invalid_type(param, "an integer", value)
        _in_range(param, value, low, high, "integer")

    return check


def number(low: float, high: float) -> Check:
    def check(value: object, param: str) -> None:
        if type(value) is not int and type(value) is not float:
            raise invalid_type(param, "a number", value)
        _in_range(param, value, low, high, "decimal")

    return check


def one_of(*choices: str) -> Check:
    """One of the strings; null (a required field left out) is no choice."""

    def check(value: object, param: str) -> None:
        if value is not None:
            string(value, param)
        if value not in choices:
            raise BadRequest(
                f"Invalid value for '{param}': expected one of {', '.join(choices)}.",
                param=param,
                code="invalid_value",
            )

    return check


def array_of(item: Check, *, non_empty: bool = False, max_items: int | None = None) -> Check:
    def check(value: object, param: str) -> None:
        if type(value) is not list:
            raise invalid_type(param, "an array", value)
        if non_empty and not value:
            raise empty_array(param)
        if max_items is not None and len(value) > max_items:
            raise BadRequest(
                f"Invalid '{param}': array too long. Expected an array with maximum length "
                f"{max_items}, but got an array with length {len(value)} instead.",
                param=param,
                code="array_above_max_length",
            )
        for i, element in enumerate(value):
            item(element, f"{param}[{i}]")

    return check


def fields(spec: Mapping[str, Check], *, required: Collection[str] = ()) -> Check:
    """An object whose listed fields, where present and not null, pass their checks; fields
    not listed are not looked at (they pass to the backend untouched). A `required` field's
    check sees null when the field is left out."""

    def check(value: object, param: str) -> None:
        if type(value) is not dict:
            raise invalid_type(param, "an object", value)
        for name, field_check in spec.items():
            field = value.get(name)
            if field is not None or name in required:
                field_check(field, f"{param}.{name}")

    return check


def values_of(item: Check) -> Check:
    """An object used as a map: every value passes `item`."""

    def check(value: object, param: str) -> None:
        if type(value) is not dict:
            raise invalid_type(param, "an object", value)
        for key, element in value.items():
            item(element, f"{param}.{key}")

    return check


def by_type(expected: str, choices: Mapping[type, Check]) -> Check:
    """A value of one of several JSON types (`"stop": "x"` or `"stop": ["x", "y"]`)."""

    def check(value: object, param: str) -> None:
        chosen = choices.get(type(value))
        if chosen is None:
            raise invalid_type(param, expected, value)
        chosen(value, param)

    return check


def _in_range(param: str, value: float, low: float, high: float, kind: str) -> None:
    if value < low:
        raise BadRequest(
            f"Invalid '{param}': {kind} below minimum value. "
            f"Expected a value >= {low}, but got {value} instead.",
            param=param,
            code=f"{kind}_below_min_value",
        )
    if value > high:
        raise BadRequest(
            f"Invalid '{param}': {kind} above maximum value. "
            f"Expected a value <= {high}, but got {value} instead.",
            param=param,
            code=f"{kind}_above_max_value",
        )
