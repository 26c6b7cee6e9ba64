"""The user field and request tags: what is recorded, and what is refused with a 400."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from proxy.context import Admitted
from proxy.errors import BadRequest
from proxy.stages.attribute import MAX_TAGS, MAX_USER_CHARS, Attribute
from proxy.stages.auth import Keyring
from tests.conftest import ALPHA_KEY, make_policy
from tests.contexts import admitted

pytestmark = pytest.mark.anyio


async def attributed(body: dict[str, Any], tags: str | None = None) -> Admitted:
    headers = {} if tags is None else {"x-tokenweir-tags": tags}
    ctx = admitted(body=body, headers=headers)
    await Attribute()(ctx)
    return ctx


async def test_user_and_tags_from_header_and_metadata() -> None:
    ctx = await attributed(
        {"user": "ann@example.com", "metadata": {"feature": "search", "team": "web/eu"}},
        tags=" beta, search,,v=2 ",
    )
    assert ctx.end_user == "ann@example.com"
    assert ctx.tags == ("beta", "search", "v=2", "web/eu")  # each once, header first


async def test_nothing_to_attribute() -> None:
    ctx = await attributed({"user": "", "metadata": {"note": ""}})
    assert (ctx.end_user, ctx.tags) == (None, ())


@pytest.mark.parametrize(
    ("body", "tags", "param"),
    [
        ({}, "has space", "x-tokenweir-tags"),
        ({}, "x" * 65, "x-tokenweir-tags"),
        ({}, "(other)", "x-tokenweir-tags"),
        ({}, "café", "x-tokenweir-tags"),
        ({}, ",".join(f"t{i}" for i in range(MAX_TAGS + 1)), "x-tokenweir-tags"),
        ({"user": "u" * (MAX_USER_CHARS + 1)}, None, "user"),
        ({"user": "line\nbreak"}, None, "user"),
    ],
)
async def test_out_of_bounds_input_is_a_clear_400(
    body: dict[str, Any], tags: str | None, param: str
) -> None:
    with pytest.raises(BadRequest) as refused:
        await attributed(body, tags)
    assert refused.value.status == 400
    assert refused.value.param == param


async def test_metadata_is_the_clients_and_only_its_tag_shaped_values_tag() -> None:
    """OpenAI lets metadata hold any string up to 512 characters: one that is no tag is left to
    pass through, never a 400; tag-shaped values fill what the header leaves of MAX_TAGS."""
    body = {"metadata": {"why": "a long sentence", "feature": "search", "n": 3}}
    ctx = await attributed(body, "beta")
    assert ctx.tags == ("beta", "search")
    assert ctx.body["metadata"]["why"] == "a long sentence"
    many = {"metadata": {f"k{i}": f"m{i}" for i in range(MAX_TAGS)}}
    ctx = await attributed(many, "a,b,c")
    assert ctx.tags == ("a", "b", "c", "m0", "m1", "m2", "m3", "m4")


async def test_bounds_themselves_are_accepted() -> None:
    tags = ",".join(f"t{i}" for i in range(MAX_TAGS - 1)) + "," + "x" * 64
    ctx = await attributed({"user": "u" * MAX_USER_CHARS}, tags)
    assert len(ctx.tags) == MAX_TAGS
    assert ctx.end_user == "u" * MAX_USER_CHARS


def test_a_policy_key_is_named_by_a_prefix_of_its_hash_never_the_key() -> None:
    keyring = Keyring(make_policy("http://127.0.0.1:9"))
    tenant, key_id, record = keyring.identify_key(f"Bearer {ALPHA_KEY}")
    assert (tenant, record) == ("alpha", None)
    assert key_id == "sha256:" + hashlib.sha256(ALPHA_KEY.encode()).hexdigest()[:12]
    assert ALPHA_KEY not in key_id


@pytest.mark.parametrize(
    "user",
    [
        "علی\u200cرضا",  # a Persian name: the ZWNJ is part of its spelling
        "👨\u200d👩\u200d👧",  # an emoji ZWJ sequence
        "山田\u3000太郎",  # a Japanese name with its full-width space
        "\U0001fae8 fan",  # an emoji newer than Python 3.11's Unicode 14
        "José",
    ],
)
async def test_a_user_in_any_script_or_emoji_is_recorded_as_sent(user: str) -> None:
    ctx = await attributed({"user": user})
    assert ctx.end_user == user


@pytest.mark.parametrize("char", ["\n", "\x85", "\u2028", "\u202e", "\ufeff", "\x7f"])
async def test_a_user_with_a_character_that_breaks_a_line_or_reorders_it_is_refused(
    char: str,
) -> None:
    with pytest.raises(BadRequest) as refused:
        await attributed({"user": f"ann{char}bob"})
    assert refused.value.param == "user"
    assert f"U+{ord(char):04X}" in refused.value.message


async def test_a_refused_tag_in_utf8_is_named_as_the_client_wrote_it() -> None:
    """The server reads a header as Latin-1: the message named 'cafÃ©'."""
    with pytest.raises(BadRequest) as refused:
        await attributed({}, "ok," + "café".encode().decode("latin-1"))
    assert "The tag 'café' in x-tokenweir-tags" in refused.value.message
    with pytest.raises(BadRequest) as refused:  # à ends in the byte 0xA0, Latin-1's NBSP
        await attributed({}, "voilà, ok".encode().decode("latin-1"))
    assert "The tag 'voilà' in x-tokenweir-tags" in refused.value.message
