"""JSON text of a parsed value at any depth: orjson reads 1024 levels but writes 254, and a
backend's answer (its error fields, a tool call's input) may nest anywhere in between."""

from __future__ import annotations

import orjson

__all__ = ["json_text"]


def json_text(value: object) -> str:
    """`value` (as orjson reads JSON) as compact JSON text. Deeper than orjson writes, it is
    written here level by level, without recursion (Python's own writers stop near 1000)."""
    try:
        return orjson.dumps(value).decode()
    except orjson.JSONEncodeError:
        pass
    texts: list[str] = []
    pending: list[object] = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, tuple):  # punctuation or a key, as written (JSON has no tuples)
            texts.append(item[0])
        elif isinstance(item, dict):
            members: list[object] = []
            for key, member in item.items():
                comma = "," if members else ""
                members += [(comma + orjson.dumps(key).decode() + ":",), member]
            pending += [("}",), *reversed(members)]
            texts.append("{")
        elif isinstance(item, list):
            members = []
            for member in item:
                members += [(",",), member] if members else [member]
            pending += [("]",), *reversed(members)]
            texts.append("[")
        else:
            texts.append(orjson.dumps(item).decode())
    return "".join(texts)
