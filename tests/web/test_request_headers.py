"""The request headers the stages read answer `get` as Starlette's Headers do."""

from __future__ import annotations

import pytest
from starlette.datastructures import Headers

from proxy.asgi.headers import RequestHeaders

RAW = [
    (b"host", b"gw"),
    (b"authorization", b"Bearer sk-one"),
    (b"x-tokenweir-tags", b"a,b"),
    (b"authorization", b"Bearer sk-two"),
    (b"x-caf\xe9", b"cr\xe8me"),
]


@pytest.mark.parametrize(
    "name", ["authorization", "Authorization", "x-tokenweir-tags", "x-café", "x-tokenweir-cache"]
)
def test_get_answers_as_starlette_does(name: str) -> None:
    scope = {"type": "http", "headers": RAW}
    ours, theirs = RequestHeaders(scope=scope), Headers(scope=scope)
    assert ours.get(name) == theirs.get(name)
    assert ours.get(name, "none") == theirs.get(name, "none")


def test_the_first_of_a_repeated_header_is_read_and_a_missing_one_is_the_default() -> None:
    headers = RequestHeaders(scope={"type": "http", "headers": RAW})
    assert headers.get("AUTHORIZATION") == "Bearer sk-one"
    assert headers.get("x-tokenweir-cache", "") == ""
    assert headers.get("x-tokenweir-cache") is None
    assert "traceparent" not in headers
    assert headers["host"] == "gw"
