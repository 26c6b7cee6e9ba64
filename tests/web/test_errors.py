"""Bad input and backend trouble: OpenAI-shaped errors with OpenAI's statuses, never a bare 500."""

from __future__ import annotations

import gzip
import socket
from collections.abc import Iterator

import httpx
import openai
import orjson
import pytest

from proxy.app import create_app
from tests.conftest import ALPHA_KEY, make_policy
from tests.servers import serve

AUTH = {"authorization": f"Bearer {ALPHA_KEY}"}
CHAT = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def assert_openai_error(answer: httpx.Response, status: int, code: str | None) -> dict[str, object]:
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"] == "application/json"
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str)
    assert error["message"]
    assert error["code"] == code
    assert "Traceback" not in answer.text
    return dict(error)


@pytest.fixture
def http(gateway_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway_url, timeout=10) as client:
        yield client


def test_malformed_json_is_400(http: httpx.Client) -> None:
    answer = http.post("/v1/chat/completions", content=b'{"model": "mock-llm",', headers=AUTH)
    assert_openai_error(answer, 400, "invalid_json")


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        (b'{"model": "mock-llm", "temperature": NaN}', "unexpected character"),
        (b'{"model": "mock-llm", "temperature": 1e309}', "number is infinity"),
        (b'{"model": "mock-llm", "user": "\\ud800"}', "no low surrogate"),
        (b'{"model": "mock-llm", "user": "\xff"}', "not valid UTF-8"),
        (b'\xef\xbb\xbf{"model": "mock-llm"}', "byte order mark"),
        (b"", "empty document"),
    ],
)
def test_json_the_parser_refuses_is_400_saying_why(
    http: httpx.Client, raw: bytes, named: str
) -> None:
    """Each was told only that its JSON could not be parsed, not what or where."""
    answer = http.post("/v1/chat/completions", content=raw, headers=AUTH)
    message = str(assert_openai_error(answer, 400, "invalid_json")["message"])
    assert named in message
    assert "line 1 column" in message or not raw


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        # Latin-1's café: orjson said "surrogates not allowed ... line 1 column 1"
        (
            '{"model": "mock-llm", "user": "café"}'.encode("latin-1"),
            "E9 at byte 34: line 1 column 35",
        ),
        (b'{"model": "mock-llm",\n "user": "\xc0\xaf"}', "C0 at byte 32: line 2 column 11"),
        (
            '{"model": "mock-llm"}'.encode("utf-16"),
            "FF at byte 0 (a UTF-16 or UTF-32 byte order mark)",
        ),
    ],
)
def test_a_body_not_in_utf8_is_told_where_it_stops_being_utf8(
    http: httpx.Client, raw: bytes, named: str
) -> None:
    answer = http.post("/v1/chat/completions", content=raw, headers=AUTH)
    message = str(assert_openai_error(answer, 400, "invalid_json")["message"])
    assert f"bytes not valid UTF-8: {named}" in message
    assert "surrogates" not in message


def test_body_that_is_not_an_object_is_400(http: httpx.Client) -> None:
    answer = http.post("/v1/chat/completions", content=b"[1, 2]", headers=AUTH)
    assert_openai_error(answer, 400, "invalid_json")


@pytest.mark.parametrize(
    ("change", "param", "code"),
    [
        ({"max_tokens": "many"}, "max_tokens", "invalid_type"),
        ({"max_tokens": -5}, "max_tokens", "integer_below_min_value"),
        ({"max_tokens": 0}, "max_tokens", "integer_below_min_value"),
        ({"max_tokens": 10**12}, "max_tokens", "integer_above_max_value"),
        ({"max_completion_tokens": 2.5}, "max_completion_tokens", "invalid_type"),
        ({"temperature": 7}, "temperature", "decimal_above_max_value"),
        ({"temperature": "hot"}, "temperature", "invalid_type"),
        ({"stream": "yes"}, "stream", "invalid_type"),
        ({"messages": "hello"}, "messages", "invalid_type"),
        ({"messages": []}, "messages", "empty_array"),
        ({"messages": [{"content": "no role"}]}, "messages[0].role", "invalid_value"),
        ({"model": 42}, "model", "invalid_type"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ],
)
def test_wrong_fields_are_400_naming_the_param(
    http: httpx.Client, change: dict[str, object], param: str, code: str
) -> None:
    answer = http.post("/v1/chat/completions", json={**CHAT, **change}, headers=AUTH)
    error = assert_openai_error(answer, 400, code)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


def test_missing_model_and_messages(http: httpx.Client) -> None:
    answer = http.post("/v1/chat/completions", json={"messages": CHAT["messages"]}, headers=AUTH)
    assert assert_openai_error(answer, 400, "missing")["param"] == "model"
    answer = http.post("/v1/chat/completions", json={"model": "mock-llm"}, headers=AUTH)
    assert assert_openai_error(answer, 400, "missing")["param"] == "messages"
    answer = http.post("/v1/embeddings", json={"model": "mock-embed"}, headers=AUTH)
    assert assert_openai_error(answer, 400, "missing")["param"] == "input"


def test_body_over_the_cap_is_413(http: httpx.Client) -> None:
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 70_000}]}
    assert_openai_error(
        http.post("/v1/chat/completions", json=big, headers=AUTH), 413, "request_too_large"
    )


def test_chunked_body_over_the_cap_is_413(http: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "mock-llm", "messages": [{"role": "user", "content": "'
        for _ in range(20):
            yield b"y" * 8192
        yield b'"}]}'

    answer = http.post("/v1/chat/completions", content=chunks(), headers=AUTH)
    assert_openai_error(answer, 413, "request_too_large")


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/chat/completions", CHAT), ("/v1/embeddings", {"model": "mock-embed", "input": "hi"})],
)
def test_a_compressed_body_is_400_naming_its_encoding(
    http: httpx.Client, path: str, body: dict[str, object]
) -> None:
    """It was told only that its JSON could not be parsed."""
    squeezed = gzip.compress(orjson.dumps(body))
    headers = {**AUTH, "content-encoding": "gzip", "content-type": "application/json"}
    answer = http.post(path, content=squeezed, headers=headers)
    error = assert_openai_error(answer, 400, "unsupported_content_encoding")
    assert "Content-Encoding: gzip" in str(error["message"])
    plain = {**headers, "content-encoding": "identity"}
    assert http.post(path, content=orjson.dumps(body), headers=plain).status_code == 200


def test_a_body_with_a_compressing_transfer_coding_is_400_naming_it(gateway_url: str) -> None:
    """`Transfer-Encoding: gzip, chunked`: the server takes the chunks off, not the gzip, and the
    client was told only that its JSON could not be parsed."""
    squeezed = gzip.compress(orjson.dumps(CHAT))
    host, port = gateway_url.removeprefix("http://").split(":")
    lines = [
        "POST /v1/chat/completions HTTP/1.1",
        "host: x",
        "content-type: application/json",
        f"authorization: {AUTH['authorization']}",
        "transfer-encoding: gzip, chunked",  # httpx sends no coding but chunked
    ]
    chunked = b"%x\r\n%b\r\n0\r\n\r\n" % (len(squeezed), squeezed)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall("\r\n".join(lines).encode() + b"\r\n\r\n" + chunked)
        raw = b""
        while b"}}" not in raw:
            chunk = sock.recv(65536)
            assert chunk, raw
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400")
    error = orjson.loads(body)["error"]
    assert error["code"] == "unsupported_transfer_encoding"
    assert "Transfer-Encoding: gzip, chunked" in error["message"]


def test_missing_and_wrong_keys_are_401(http: httpx.Client) -> None:
    assert_openai_error(http.post("/v1/chat/completions", json=CHAT), 401, "invalid_api_key")
    wrong = {"authorization": "Bearer not-a-key"}
    error = assert_openai_error(
        http.post("/v1/chat/completions", json=CHAT, headers=wrong), 401, "invalid_api_key"
    )
    assert "not-a-key" not in str(error["message"])
    basic = {"authorization": "Basic dXNlcjpwYXNz"}
    assert_openai_error(http.get("/v1/models", headers=basic), 401, "invalid_api_key")


def test_model_not_allowed_is_403_and_unknown_model_404(http: httpx.Client) -> None:
    forbidden = http.post(
        "/v1/chat/completions", json={**CHAT, "model": "mock-small"}, headers=AUTH
    )
    assert assert_openai_error(forbidden, 403, "model_not_allowed")["type"] == "permission_error"
    unknown = http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"}, headers=AUTH)
    assert assert_openai_error(unknown, 404, "model_not_found")["param"] == "model"


def test_unknown_route_and_wrong_method(http: httpx.Client) -> None:
    assert_openai_error(http.get("/v1/nothing-here"), 404, "not_found")
    assert_openai_error(http.get("/v1/chat/completions"), 405, "method_not_allowed")


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/chat/completions/"),
        ("POST", "/v1/embeddings/"),
        ("GET", "/v1/models/"),
        ("GET", "/healthz/"),
        ("GET", "/dashboard/"),
    ],
)
def test_a_path_with_a_trailing_slash_is_a_404_naming_the_route(
    http: httpx.Client, method: str, path: str
) -> None:
    """It was Starlette's bare 307 with an empty body, to the Host header's name over plain
    http (a client that follows it resends its POST there, without its key behind a TLS proxy)."""
    answer = http.request(method, path, headers=AUTH, json=CHAT)
    assert "location" not in answer.headers
    if path == "/v1/models/":  # `/v1/models/{id}` with an empty id
        assert_openai_error(answer, 404, "model_not_found")
        return
    error = assert_openai_error(answer, 404, "not_found")
    assert f"The route is {path.rstrip('/')}, without the trailing slash." in str(error["message"])


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", "/v1/chat/completions", "POST"),
        ("OPTIONS", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/messages", "POST"),
        ("POST", "/v1/models", "GET, HEAD"),
        ("DELETE", "/healthz", "GET, HEAD"),
    ],
)
def test_a_method_a_route_does_not_take_is_a_405_with_allow(
    http: httpx.Client, method: str, path: str, allowed: str
) -> None:
    """A 405 must say which methods the route takes; the gateway's carried no `Allow`."""
    answer = http.request(method, path, headers=AUTH)
    assert answer.status_code == 405
    assert set(answer.headers["allow"].split(", ")) == set(allowed.split(", "))
    if path != "/v1/messages":  # Anthropic's shape there
        assert_openai_error(answer, 405, "method_not_allowed")
    head = http.head("/v1/chat/completions", headers=AUTH)
    assert head.status_code == 405
    assert head.headers["allow"] == "POST"


def test_backend_error_status_becomes_502(http: httpx.Client) -> None:
    answer = http.post("/v1/chat/completions", json={**CHAT, "mock_fail": 500}, headers=AUTH)
    assert assert_openai_error(answer, 502, "upstream_error")["type"] == "api_error"


def test_backend_4xx_passes_through_with_its_fields(http: httpx.Client) -> None:
    answer = http.post("/v1/chat/completions", json={**CHAT, "mock_fail": 400}, headers=AUTH)
    assert answer.status_code == 400
    assert answer.json()["error"]["type"] == "invalid_request_error"


def test_backend_429_keeps_retry_after(http: httpx.Client) -> None:
    body = {**CHAT, "mock_fail": 429, "mock_retry_after_s": 7}
    answer = http.post("/v1/chat/completions", json=body, headers=AUTH)
    assert answer.status_code == 429
    assert answer.headers["retry-after"] == "7"


def test_backend_refusing_connections_is_502() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    with serve(create_app(make_policy(f"http://127.0.0.1:{closed_port}"))) as url:
        answer = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=AUTH)
        assert_openai_error(answer, 502, "upstream_error")
        ready = httpx.get(url + "/readyz")
        assert ready.status_code == 503
        assert ready.json()["models_without_backend"]


def test_backend_timeout_is_504(backend_url: str) -> None:
    policy = make_policy(backend_url, read_timeout="300ms")
    with serve(create_app(policy)) as url:
        body = {**CHAT, "mock_delay_ms": 1500}
        answer = httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=10)
        assert_openai_error(answer, 504, "upstream_timeout")
        answer = httpx.post(
            url + "/v1/chat/completions", json={**body, "stream": True}, headers=AUTH
        )
        assert_openai_error(answer, 504, "upstream_timeout")


def test_backend_dying_mid_stream_ends_with_error_event_and_no_done(gateway_url: str) -> None:
    body = {**CHAT, "max_tokens": 50, "stream": True, "mock_fail_after_tokens": 5}
    with httpx.stream(
        "POST", gateway_url + "/v1/chat/completions", json=body, headers=AUTH
    ) as answer:
        assert answer.status_code == 200
        events = [line for line in answer.iter_lines() if line.startswith("data:")]
    assert "[DONE]" not in events[-1]
    error = orjson.loads(events[-1].removeprefix("data:"))["error"]
    assert error["code"] == "upstream_error"
    contents = [
        orjson.loads(e.removeprefix("data:"))["choices"][0]["delta"].get("content")
        for e in events[:-1]
    ]
    assert sum(1 for c in contents if c) == 5


def test_sdk_raises_its_own_error_classes(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.PermissionDeniedError):
        client.chat.completions.create(
            model="mock-small", messages=[{"role": "user", "content": "x"}]
        )
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="mock-llm", messages=[], max_tokens=3)
