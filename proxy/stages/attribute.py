"""Who below the tenant a request is for: the OpenAI `user` field (Anthropic's
`metadata.user_id` on /v1/messages) and request tags, checked.

Writes end_user and tags. Tags come from the `x-tokenweir-tags: a,b` header, checked (a bad
one is a 400, never cut silently), and from the string values of the body's `metadata` object that
are tag-shaped: metadata is the client's own (OpenAI allows 512-character values), so a value that
is not a tag is left to pass through, not refused; they fill what the header leaves of MAX_TAGS.
"""

from __future__ import annotations

import re

from proxy.context import Admitted
from proxy.errors import BadRequest

__all__ = ["MAX_TAGS", "MAX_TAG_CHARS", "MAX_USER_CHARS", "TAGS_HEADER", "Attribute"]

TAGS_HEADER = "x-tokenweir-tags"
MAX_TAGS = 8
MAX_TAG_CHARS = 64
MAX_USER_CHARS = 128
_TAG = re.compile(r"[A-Za-z0-9_.:/=@+-]{1,64}")
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
            for tag in header.split(","):
                if tag.strip():
                    tags[_tag(tag.strip(), TAGS_HEADER)] = None
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
    if len(value) > MAX_USER_CHARS or not value.isprintable():
        raise BadRequest(
            f"{where} must be at most {MAX_USER_CHARS} printable characters; "
            f"this one has {len(value)}.",
            param=where,
            code="invalid_user",
        )
    return value


def _tag(tag: str, where: str) -> str:
    if _TAG.fullmatch(tag) is None:
        shown = tag[:MAX_TAG_CHARS] + ("..." if len(tag) > MAX_TAG_CHARS else "")
        raise BadRequest(
            f"The tag {shown!r} in {where} is not a valid tag: a tag is {_TAG_RULE}.",
            param=where,
            code="invalid_tags",
        )
    return tag
