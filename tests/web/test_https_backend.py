"""A backend over https (the gateway's own transport over TLS): the openai SDK
gets the same answers, streamed and whole, as from one over http."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from proxy.app import create_app
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from tests.certs import self_signed
from tests.conftest import ALPHA_KEY
from tests.servers import serve
from tests.web.lyingbackend import WORD, WORDS, lying_backend

HELLO = [{"role": "user", "content": "Say hello twelve times."}]


@pytest.fixture
def client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[openai.OpenAI]:
    cert, key = self_signed(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the gateway's https client trusts it
    with lying_backend(tls=(cert, key)) as (_, backend_url):
        assert backend_url.startswith("https://")
        policy = parse_policy(
            f"""
storage: memory
upstream: {{connect_timeout: 2s, read_timeout: 5s}}
backends:
  - {{name: secure, url: "{backend_url}/v1", models: [tls-llm]}}
models:
  tls-llm: {{price: {{input_per_1m: 1.0, output_per_1m: 2.0}}}}
tenants:
  alpha: {{api_keys: [{hash_key(ALPHA_KEY)}], models: [tls-llm]}}
""",
            file="https.yaml",
            environ={},
        )
        with serve(create_app(policy)) as url:
            yield openai.OpenAI(base_url=url + "/v1", api_key=ALPHA_KEY, max_retries=0)


def test_a_stream_from_an_https_backend_arrives_whole(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="tls-llm",
            messages=HELLO,  # type: ignore[arg-type]
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == WORD * WORDS
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = chunks[-1].usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (9, 12)


def test_a_whole_answer_from_an_https_backend(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(model="tls-llm", messages=HELLO)  # type: ignore[arg-type]
    assert answer.choices[0].message.content == WORD * WORDS
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 12
