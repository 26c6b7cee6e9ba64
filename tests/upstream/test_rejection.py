"""A backend's Retry-After and error fields, as the gateway passes them on."""

from __future__ import annotations

import httpx
import orjson
import pytest

from proxy.policy.model import Backend
from proxy.upstream.rejection import (
    MAX_RETRY_AFTER_S,
    UpstreamRejected,
    retry_after_s,
    status_error,
)

NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z


@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        ("7", 7),
        (" 12 ", 12),
        ("1.2", 2),  # rounded up: never earlier than asked
        ("0", 0),
        ("1e300", MAX_RETRY_AFTER_S),
        ("9" * 400, MAX_RETRY_AFTER_S),  # too large even for a float
        ("Fri, 15 Jan 2027 08:00:30 GMT", 30),
        ("Fri, 15 Jan 2027 07:00:00 GMT", 0),  # already past
        ("Sun, 15 Jan 2040 08:00:00 GMT", MAX_RETRY_AFTER_S),
        ("nan", None),
        ("inf", None),
        ("-inf", None),
        ("infinity", None),
        ("-5", None),
        ("+5", None),
        ("soon", None),
        ("", None),
        (None, None),
        ("Fri, 99 Jan 2027 08:00:30 GMT", None),
        ("0x10", None),
    ],
)
def test_retry_after_is_whole_seconds_in_range_or_dropped(
    header: str | None, seconds: int | None
) -> None:
    assert retry_after_s(header, lambda: NOW) == seconds


def test_error_fields_that_are_not_strings_come_back_as_json_text() -> None:
    rejected = UpstreamRejected(
        400,
        {"message": ["a", 1], "type": {"t": 1}, "code": {"reason": "x"}, "param": 3},
    )
    assert rejected.body()["error"] == {
        "message": '["a",1]',
        "type": '{"t":1}',
        "param": "3",
        "code": '{"reason":"x"}',
    }


def test_error_fields_are_bounded_and_absent_ones_defaulted() -> None:
    rejected = UpstreamRejected(422, {"message": "m" * 100_000, "code": ""})
    error = rejected.body()["error"]
    assert isinstance(error, dict)
    assert len(error["message"]) < 2100
    assert error["code"] is None
    assert error["type"] == "invalid_request_error"
    assert UpstreamRejected(404, {}).message == "the backend answered 404"


def _rejected(api_key: str, body: dict[str, object]) -> dict[str, object]:
    backend = Backend(name="b", url="http://127.0.0.1:9/v1", api_key=api_key, models=("m",))
    error = status_error(backend, httpx.Response(400), orjson.dumps(body))
    assert isinstance(error, UpstreamRejected)
    fields = error.body()["error"]
    assert isinstance(fields, dict)
    return fields


def test_the_backends_key_is_cut_from_its_error_and_a_placeholder_key_is_not() -> None:
    """A real key echoed anywhere in the error is replaced; a placeholder (vLLM's `EMPTY`) is
    no secret, and cutting it would garble a message that uses the word."""
    key = "sk-live-0123456789"
    echoed = _rejected(key, {"error": {"message": f"bad key {key}", "code": {"k": key}}})
    assert echoed["message"] == "bad key [the gateway's backend key]"
    assert echoed["code"] == '{"k":"[the gateway\'s backend key]"}'
    said = {"error": {"message": "EMPTY input is not allowed", "param": "input"}}
    assert _rejected("EMPTY", said)["message"] == "EMPTY input is not allowed"
