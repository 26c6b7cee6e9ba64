"""Who below the tenant a request is for: the OpenAI `user` field (Anthropic's
`metadata.user_id` on /v1/messages) and request tags, checked.

Writes end_user and tags. Tags come from the `x-tokenweir-tags: a,b` header, checked (a bad
one is a 400, never cut silently), and from the string values of the body's `metadata` object that
are tag-shaped: metadata is the client's own (OpenAI allows 512-character values), so a value that
is not a tag is left to pass through, not refused; they fill what the header leaves of MAX_TAGS.
"""

from __future__ import annotations

import re
import unicodedata

from proxy.context import Admitted
from proxy.errors import BadRequest

__all__ = ["MAX_TAGS", "MAX_TAG_CHARS", "MAX_USER_CHARS", "TAGS_HEADER", "Attribute"]

TAGS_HEADER = "x-tokenweir-tags"
MAX_TAGS = 8
MAX_TAG_CHARS = 64
MAX_USER_CHARS = 128
_TAG = re.compile(r"[A-Za-z0-9_.:/=@+-]{1,64}")
# What a user name may not hold, of the characters str.isprintable refuses: controls, line and
# paragraph separators, surrogates and the format characters (bidi overrides, which reorder a
# report's line on screen) but the joiners, which words and emoji need (ZWNJ in Persian, ZWJ in
# 👨‍👩‍👧). Spaces (Japanese full-width U+3000), code points newer than this Python's Unicode
# (2023's emoji) and private-use ones are text like any other.
_REFUSED_IN_USER = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_JOINERS = frozenset("\u200c\u200d")
_OWS = " \t"  # HTTP's optional whitespace around a list's items
_TAG_RULE = (
    f"1 to {MAX_TAG_CHARS} characters from letters, digits and _ . : / = @ + -, "
    f"at most {MAX_TAGS} per request"
)


class Attribute:
    async def __call__(self, ctx: Admitted) -> None:
        metadata = ctx.body.get("metadata")
        if ctx.operation == "messages":  # Anthropic names the end user in metadata.user_id
            given = metadata.get("user_id") if isinstance(metadata, dict) else None
            ctx.end_user = _user(given, "metadata.user_id")
            if isinstance(metadata, dict):
                metadata = {k: v for k, v in metadata.items() if k != "user_id"}
        else:
            ctx.end_user = _user(ctx.body.get("user"), "user")
        tags: dict[str, None] = {}
        header = ctx.headers.get(TAGS_HEADER)
        if header is not None:
            for item in header.split(","):
                tag = item.strip(_OWS)  # str.strip would take the 0xA0 that ends UTF-8's à
                if tag:
                    tags[_tag(tag, TAGS_HEADER)] = None
        if len(tags) > MAX_TAGS:
            raise BadRequest(
                f"A request may carry at most {MAX_TAGS} distinct tags in {TAGS_HEADER}; "
                f"this one has {len(tags)}.",
                param=TAGS_HEADER,
                code="invalid_tags",
            )
        if isinstance(metadata, dict):
            for value in metadata.values():
                if len(tags) == MAX_TAGS:
                    break
                if isinstance(value, str) and _TAG.fullmatch(value) is not None:
                    tags[value] = None
        ctx.tags = tuple(tags)


def _user(value: object, where: str) -> str | None:
    if not isinstance(value, str) or not value:
        return None  # parse refused a user that is not a string
    if len(value) > MAX_USER_CHARS:
        raise BadRequest(
            f"{where} must be at most {MAX_USER_CHARS} characters; this one has {len(value)}.",
            param=where,
            code="invalid_user",
        )
    refused = None if value.isprintable() else _refused_in_user(value)
    if refused is not None:
        raise BadRequest(
            f"{where} may not hold U+{ord(refused):04X}: it may hold no control, format or "
            "line-separating character (the joiners U+200C and U+200D it may).",
            param=where,
            code="invalid_user",
        )
    return value


def _refused_in_user(value: str) -> str | None:
    """The first character of `value` a user name may not hold, if any."""
    for char in value:
        if char not in _JOINERS and unicodedata.category(char) in _REFUSED_IN_USER:
            return char
    return None


def _tag(tag: str, where: str) -> str:
    if _TAG.fullmatch(tag) is None:
        tag = _as_sent(tag)
        shown = tag[:MAX_TAG_CHARS] + ("..." if len(tag) > MAX_TAG_CHARS else "")
        raise BadRequest(
            f"The tag {shown!r} in {where} is not a valid tag: a tag is {_TAG_RULE}.",
            param=where,
            code="invalid_tags",
        )
    return tag


def _as_sent(text: str) -> str:
    """A header's text as its client wrote it: the server reads a header's bytes as Latin-1, so
    UTF-8 (café) came as mojibake (cafÃ©); other bytes are shown as read."""
    try:
        return text.encode("latin-1").decode()
    except UnicodeError:
        return text
