"""Numbers in policy files: YAML's true/false is a boolean, never the number 1 or 0 (pydantic's
lax mode would take it for one), and `.inf`, `.nan` and numbers too large to count or store are
errors, wherever the policy asks for a number."""

from __future__ import annotations

import math
import types
from functools import cache
from typing import Annotated, Union, get_args, get_origin

from pydantic import BaseModel, ValidationInfo, field_validator

__all__ = ["MAX_NUMBER", "NoBoolAsNumber"]

# The largest number a policy may give: every integer up to it is exact in a float, as Redis's
# Lua scripts hold counts, and tokens or nano-USD this large still fit the ledger's integers.
MAX_NUMBER = 2**53 - 1


class NoBoolAsNumber(BaseModel):
    """A model whose numbers (int or float fields) refuse true and false."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, value: object, info: ValidationInfo) -> object:
        field = info.field_name
        if isinstance(value, bool) and field and _numeric(cls, field):
            raise ValueError(f"expected a number, not {str(value).lower()}")
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _finite_and_in_range(cls, value: object, info: ValidationInfo) -> object:
        field = info.field_name
        if not isinstance(value, int | float) or not field or not _numeric(cls, field):
            return value
        if not math.isfinite(value):
            raise ValueError(f"expected a finite number, not {value}")
        if abs(value) > MAX_NUMBER:
            raise ValueError(f"{value:g} is too large: at most {MAX_NUMBER:,}")
        return value


@cache
def _numeric(model: type[BaseModel], field: str) -> bool:
    """Whether the field takes a number (int or float) and not a boolean (`shadow: true`)."""
    kinds = _kinds(model.model_fields[field].annotation)
    return bool(kinds & {int, float}) and bool not in kinds


def _kinds(annotation: object) -> set[object]:
    """The types an annotation admits, through `X | None`, `Optional` and `Annotated`."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _kinds(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return set().union(*(_kinds(arg) for arg in get_args(annotation)))
    return {annotation}
