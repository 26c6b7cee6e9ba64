"""Headers across a real `tokenweir serve`, both ways, with a raw-socket backend
(tests/upstream/hostile.py) that records each request's head and sends exactly the bytes a test
wants: the backend gets only what the gateway writes, the client only what the gateway writes,
and the gateway's key to the backend never reaches a client, whatever the backend echoes."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest

from proxy.policy.units import hash_key
from tests.servers import replicas
from tests.upstream.hostile import (
    CHAT,
    CHUNK,
    HostileBackend,
    Misbehaviour,
    Writer,
    event,
    head,
    json_answer,
)

KEY = "tw-headers-client"
BACKEND_KEY = "sk-gateway-to-backend-7f3a9c"
MODEL = "headers-llm"
CHAT_PATH = "/v1/chat/completions"
MESSAGES_PATH = "/v1/messages"

# What a backend may send that no client of the gateway should see.
NOISY = (
    "set-cookie: session=tenant-a-secret; Path=/",
    "server: backend-server/1.0",
    "x-request-id: backend-request-id",
    "access-control-allow-origin: *",
    "access-control-allow-credentials: true",
    "x-ratelimit-limit-requests: 1",
    "x-ratelimit-remaining-requests: 0",
    "connection: keep-alive, x-hop",
    "x-hop: hop-value",
    "keep-alive: timeout=600",
    "x-backend-debug: internal-host-10.0.0.7",
    "openai-organization: backend-org",
)
# What the gateway writes on an answer (uvicorn's date and server, the gateway's own; on the
# Anthropic routes, the request id as Anthropic's `request-id` too).
GATEWAY_HEADERS = {
    "date", "server", "content-type", "content-length", "transfer-encoding", "cache-control",
    "x-accel-buffering", "x-request-id", "x-tokenweir-cache", "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests", "retry-after",
    "retry-after-ms", "x-should-retry", "request-id",
}  # fmt: skip
# What the gateway writes to the backend.
UPSTREAM_HEADERS = {
    "host", "content-type", "accept-encoding", "authorization", "x-request-id", "traceparent",
    "content-length",
}  # fmt: skip


async def noisy(server: HostileBackend, writer: Writer, request: dict[str, Any]) -> None:
    """A good answer under every header a backend could add."""
    if request.get("stream"):
        body = event(CHUNK) + b"data: [DONE]\n\n"
        length = f"content-length: {len(body)}"
        data = head("200 OK", "content-type: text/event-stream", length, *NOISY) + body
    else:
        body = orjson.dumps(CHAT)
        data = json_answer("200 OK", body, *NOISY) + body
    await server.send("noisy", writer, data)


def echoing(status: str, *, json: bool = True) -> Misbehaviour:
    """An error answer that repeats the Authorization the backend was sent, in each field (or in
    an HTML page), as a server that shows a malformed key, or dumps a request, does."""

    async def answer(server: HostileBackend, writer: Writer, request: dict[str, Any]) -> None:
        sent = _header(server.heads[-1], b"authorization")
        said = f"Malformed API Key passed in: {sent}"
        if json:
            fields = {"message": said, "type": "auth_error", "param": sent, "code": [sent]}
            body = orjson.dumps({"error": fields})
            data = json_answer(status, body, "retry-after: 2", *NOISY) + body
        else:
            body = f"<html><pre>request headers: authorization={sent}</pre></html>".encode()
            data = head(status, "content-type: text/html", f"content-length: {len(body)}") + body
        await server.send(str(request["hostile"]), writer, data)

    return answer


ECHOING = {
    "echo_400": echoing("400 Bad Request"),
    "echo_429": echoing("429 Too Many Requests"),
    "echo_503": echoing("503 Service Unavailable"),
    "echo_500_html": echoing("500 Internal Server Error", json=False),
}


@dataclass
class Gateway:
    url: str
    backend: HostileBackend


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    config = tmp_path_factory.mktemp("headers") / "policy.yaml"
    with HostileBackend(extra={"noisy": noisy, **ECHOING}) as backend:
        config.write_text(f"""
storage: memory
upstream: {{probe_interval: 0, circuit: {{failures: 100000}}}}
backends:
  - {{name: raw, url: "{backend.url}/v1", api_key: {BACKEND_KEY}, models: [{MODEL}]}}
models: {{{MODEL}: {{}}}}
tenants:
  app:
    api_keys: [{hash_key(KEY)}]
    models: [{MODEL}]
    limits: {{requests_per_minute: 1000}}
""")
        with replicas(config, 1) as [(_, url)]:
            yield Gateway(url, backend)


def _header(request_head: bytes, name: bytes) -> str:
    for line in request_head.split(b"\r\n")[1:]:
        field, _, value = line.partition(b":")
        if field.strip().lower() == name:
            return value.strip().decode()
    return ""


def post(gateway: Gateway, path: str, hostile: str, **fields: Any) -> httpx.Response:
    body: dict[str, Any] = {"model": MODEL, "hostile": hostile, **fields}
    body.setdefault("messages", [{"role": "user", "content": "hello"}])
    headers = {"authorization": f"Bearer {KEY}"}
    if path == MESSAGES_PATH:
        body["max_tokens"] = 16
        headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    return httpx.post(gateway.url + path, json=body, headers=headers, timeout=30)


def test_only_the_gateways_own_headers_reach_the_backend(gateway: Gateway) -> None:
    """The client's key (whichever header holds it), cookies, hop-by-hop and proxy headers,
    forwarded-for claims and the SDKs' own headers stay at the gateway: the backend gets the
    gateway's key, the request's id and trace context, and a length for the body it is sent."""
    sent = {
        "authorization": f"Bearer {KEY}", "x-api-key": KEY, "api-key": KEY,
        "cookie": "session=client", "connection": "keep-alive, x-client-hop",
        "x-client-hop": "1", "keep-alive": "timeout=5", "te": "trailers",
        "proxy-authorization": "Basic Zm9vOmJhcg==", "x-forwarded-for": "203.0.113.9",
        "x-forwarded-host": "evil.example", "forwarded": "for=203.0.113.9",
        "openai-organization": "client-org", "openai-beta": "assistants=v2",
        "x-stainless-lang": "python", "x-request-id": "client-chosen-id",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    }  # fmt: skip
    gateway.backend.heads.clear()
    answer = httpx.post(
        gateway.url + CHAT_PATH,
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "hostile": "noisy"},
        headers=sent,
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    [request_head] = [h for h in gateway.backend.heads if h.startswith(b"POST")]
    lines = request_head.rstrip(b"\r\n").split(b"\r\n")[1:]
    names = {line.partition(b":")[0].lower().decode() for line in lines}
    assert names <= UPSTREAM_HEADERS, names - UPSTREAM_HEADERS
    assert _header(request_head, b"authorization") == f"Bearer {BACKEND_KEY}"
    assert KEY.encode() not in request_head
    assert _header(request_head, b"x-request-id") == "client-chosen-id"
    # The backend read exactly that many bytes and found the JSON body it answered.
    assert _header(request_head, b"content-length").isdigit()


@pytest.mark.parametrize("stream", [False, True])
def test_a_backends_own_headers_never_reach_the_client(gateway: Gateway, stream: bool) -> None:
    """Set-Cookie (which a cached answer would show another tenant), hop-by-hop headers, the
    backend's Server, CORS and rate-limit headers and its request id: the client sees the
    gateway's own headers only, its rate-limit numbers and its request id."""
    answer = post(gateway, CHAT_PATH, "noisy", stream=stream)
    assert answer.status_code == 200, answer.text
    assert "fine" in answer.text
    names = {name.lower() for name, _ in answer.headers.multi_items()}
    assert names <= GATEWAY_HEADERS, names - GATEWAY_HEADERS
    assert answer.headers["server"] == "uvicorn"
    assert answer.headers["x-request-id"].startswith("req_")
    assert answer.headers["x-ratelimit-limit-requests"] == "1000"
    assert answer.headers["x-ratelimit-remaining-requests"] != "0"


@pytest.mark.parametrize("path", [CHAT_PATH, MESSAGES_PATH])
@pytest.mark.parametrize(
    ("hostile", "status"),
    [("echo_400", 400), ("echo_429", 429), ("echo_503", 503), ("echo_500_html", 502)],
)
def test_an_error_that_echoes_the_gateways_backend_key_never_shows_it(
    gateway: Gateway, path: str, hostile: str, status: int
) -> None:
    """A backend error repeating the Authorization it was sent passed the gateway's key to the
    backend on to any tenant, in the message, `param` or `code` (the 5xx message quotes the
    body). It is replaced by a placeholder; the rest of the message still says what went wrong."""
    answer = post(gateway, path, hostile)
    expected = 529 if path == MESSAGES_PATH and status == 503 else status  # Anthropic's overload
    assert answer.status_code == expected, answer.text
    assert BACKEND_KEY not in answer.text
    assert BACKEND_KEY[:12] not in answer.text  # not a part of it either
    assert all(BACKEND_KEY not in value for _, value in answer.headers.multi_items())
    assert "[the gateway's backend key]" in answer.text
    names = {name.lower() for name, _ in answer.headers.multi_items()}
    assert names <= GATEWAY_HEADERS, names - GATEWAY_HEADERS
