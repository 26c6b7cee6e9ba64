"""A real `tokenweir serve` in front of https backends (tests/upstream/hostile.py over TLS): what
only TLS can break (a corrupt record, a certificate the gateway refuses) is a 502 or a stream's
error event that says so, failed over like a refused connection; never a bare 500 or a dropped
client. The misbehaviours any backend can send are tests/reliability/test_hostile_backend.py's,
run over https too."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from proxy.policy.units import hash_key
from tests.certs import self_signed, server_tls
from tests.servers import replicas
from tests.upstream.hostile import CHUNK, HostileBackend, Writer, event, head

KEY = "tw-tls"
MODEL = "hostile-llm"
# Its backends: one whose certificate no CA signed (sent nearly every request), and a good one.
SPARED = "spared-llm"
MESSAGES: list[Any] = [{"role": "user", "content": "hello"}]
BAD_RECORD = b"\x17\x03\x03\x00\x10" + b"A" * 16  # a record the gateway's keys cannot open
BROKEN_RECORD = {  # what the client reads of it
    "message": "backend 'hostile': TLS failed: decryption failed or bad record mac",
    "type": "api_error",
    "param": None,
    "code": "upstream_error",
}


async def bad_record_before_head(server: HostileBackend, writer: Writer, request: Any) -> None:
    os.write(writer.get_extra_info("socket").fileno(), BAD_RECORD)


async def bad_record_mid_stream(server: HostileBackend, writer: Writer, request: Any) -> None:
    data = head("200 OK", "content-type: text/event-stream", "transfer-encoding: chunked")
    body = event(CHUNK)
    await server.send("bad_record_mid_stream", writer, data + b"%x\r\n%b\r\n" % (len(body), body))
    server.client_has_after.wait(10)  # the token reached the client: the stream is under way
    os.write(writer.get_extra_info("socket").fileno(), BAD_RECORD)


@dataclass
class Gateway:
    url: str
    client: openai.OpenAI
    backend: HostileBackend


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    trusted, untrusted = tmp_path_factory.mktemp("trusted"), tmp_path_factory.mktemp("untrusted")
    cert, key = self_signed(trusted)
    extra = {"bad_record_before_head": bad_record_before_head,
             "bad_record_mid_stream": bad_record_mid_stream}  # fmt: skip
    config = trusted / "policy.yaml"
    with (
        pytest.MonkeyPatch.context() as env,
        HostileBackend(extra, tls=server_tls(cert, key)) as backend,
        HostileBackend(tls=server_tls(*self_signed(untrusted))) as stranger,
    ):
        env.setenv("SSL_CERT_FILE", str(cert))  # how an operator trusts a private CA
        config.write_text(f"""
storage: memory
upstream: {{read_timeout: 5s, probe_interval: 0}}
backends:
  - {{name: stranger, url: "{stranger.url}/v1", models: [{SPARED}], weight: 1000}}
  - {{name: hostile, url: "{backend.url}/v1", models: [{MODEL}, {SPARED}]}}
models: {{{MODEL}: {{}}, {SPARED}: {{routing: weighted}}}}
tenants:
  app: {{api_keys: [{hash_key(KEY)}], models: [{MODEL}, {SPARED}]}}
""")
        with (
            replicas(config, 1) as [(_, url)],
            openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30) as client,
        ):
            yield Gateway(url, client, backend)


def chat(gateway: Gateway, hostile: str, model: str = MODEL, **fields: Any) -> Any:
    return gateway.client.chat.completions.create(
        model=model, messages=MESSAGES, extra_body={"hostile": hostile}, **fields
    )


def test_a_broken_tls_record_before_the_head_is_a_502_that_says_so(gateway: Gateway) -> None:
    """It was a 500 internal_error: httpcore raised the bare ssl.SSLError."""
    with pytest.raises(openai.APIStatusError) as caught:
        chat(gateway, "bad_record_before_head")
    assert caught.value.status_code == 502
    assert caught.value.body == BROKEN_RECORD
    assert chat(gateway, "normal").choices[0].message.content == "fine"


def test_a_broken_tls_record_mid_stream_ends_it_with_an_error_event(gateway: Gateway) -> None:
    """The client's connection was dropped with no error event (the SDK's APIConnectionError)."""
    gateway.backend.client_has_after.clear()
    seen: list[str] = []

    def read_to_the_end() -> None:
        for chunk in chat(gateway, "bad_record_mid_stream", stream=True):
            seen.extend(c.delta.content or "" for c in chunk.choices)
            gateway.backend.client_has_after.set()

    with pytest.raises(openai.APIError) as caught:
        read_to_the_end()
    assert seen == ["fine"]
    assert not isinstance(caught.value, openai.APIConnectionError | openai.APIStatusError)
    assert caught.value.body == BROKEN_RECORD
    assert chat(gateway, "normal").choices[0].message.content == "fine"


def test_a_certificate_refused_fails_over_and_readyz_says_why(gateway: Gateway) -> None:
    for _ in range(3):
        assert chat(gateway, "normal", model=SPARED).choices[0].message.content == "fine"
    ready = httpx.get(gateway.url + "/readyz", timeout=30).json()
    reason = "its TLS certificate was refused: self-signed certificate"
    assert ready["backends"] == {"stranger": reason, "hostile": "ok"}
