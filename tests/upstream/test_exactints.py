"""The outgoing body's integers past 64 bits, as the client wrote them (upstream/exactints.py)."""

from __future__ import annotations

import json

import orjson

from proxy.upstream.exactints import as_written


def _sent(raw: bytes) -> bytes:
    body = orjson.loads(raw)
    return as_written(orjson.dumps(body), body, raw)


def _untouched(raw: bytes) -> bool:
    """Is the body orjson wrote sent as it is (the same object, not written again)?"""
    body = orjson.loads(raw)
    content = orjson.dumps(body)
    return as_written(content, body, raw) is content


def test_a_body_without_a_plus_is_the_same_bytes() -> None:
    assert _untouched(b'{"model": "m", "seed": 7, "x": [1.5, -0.0]}')


def test_a_float_the_client_wrote_so_stays_a_float() -> None:
    raw = b'{"a": 1.8446744073709552e19, "b": "x+y", "c": 1e300}'
    assert _sent(raw) == orjson.dumps(orjson.loads(raw))


def test_each_integer_past_64_bits_is_written_as_it_came_and_the_body_is_not_changed() -> None:
    raw = b'{"a": [18446744073709551616, {"b": -9223372036854775809}], "c": "1e+19", "d": 2}'
    body = orjson.loads(raw)
    sent = as_written(orjson.dumps(body), body, raw)
    assert json.loads(sent) == {
        "a": [2**64, {"b": -(2**63) - 1}],
        "c": "1e+19",
        "d": 2,
    }
    assert body["a"][0] == float(2**64)  # the request's own body, as parse read it


def test_text_that_reads_like_an_exponent_leaves_the_body_as_orjson_wrote_it() -> None:
    assert _untouched(b'{"messages": [{"role": "user", "content": "Is 1e+20 C++ enough? 3e+300"}]}')


def test_digit_runs_in_text_and_floats_are_no_integers() -> None:
    """A run of digits in a string, a float's long fraction or integer part, 5,000 digits of
    text (past what Python's `int` reads from text): the body as orjson wrote it, bar the one
    integer past 64 bits."""
    raw = (
        b'{"a": 0.12345678901234567890123, "b": 12345678901234567890123.5, "c": 2e19, '
        b'"d": "' + b"9" * 5000 + b'", "e": -123456789012345678901234, "f": "x'
        b'123456789012345678901234"}'
    )
    sent = json.loads(_sent(raw))
    assert sent["e"] == -123456789012345678901234
    assert type(sent["a"]) is type(sent["b"]) is type(sent["c"]) is float
    assert sent["d"] == "9" * 5000
