"""A reload that moves a backend moves the semantic cache's embedder and verifier with it: once
the old backend is gone, reworded questions are still semantic hits."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import httpx

from proxy.app import create_app
from proxy.policy.units import hash_key
from proxy.tools.mock import backend as mockbackend
from tests.servers import serve

ADMIN_KEY = "tw-cache-reload-admin"
ALPHA_KEY = "tw-cache-reload-alpha"


def _policy_text(backend_url: str) -> str:
    verifier = "{backend: mock, model: mock-rerank, threshold: 0.4}"
    return f"""storage: memory
admin_keys: [{hash_key(ADMIN_KEY)}]
embedder: {{model: mock-embed, timeout: 2s}}
backends: [{{name: mock, url: "{backend_url}/v1", models: [mock-llm, mock-embed]}}]
models: {{mock-llm: {{}}, mock-embed: {{}}}}
tenants:
  alpha:
    api_keys: [{hash_key(ALPHA_KEY)}]
    models: [mock-llm]
    cache: {{mode: semantic, similarity: 0.95, verifier: {verifier}}}
"""


def _ask(url: str, question: str) -> httpx.Response:
    body = {"model": "mock-llm", "messages": [{"role": "user", "content": question}]}
    auth = {"authorization": f"Bearer {ALPHA_KEY}"}
    return httpx.post(url + "/v1/chat/completions", json={**body, "temperature": 0}, headers=auth)


def test_a_reload_that_moves_the_backend_moves_the_embedder_and_the_verifier(
    tmp_path: Path,
) -> None:
    config = tmp_path / "policy.yaml"
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    with ExitStack() as stack, ExitStack() as retired:
        new_url = stack.enter_context(serve(_mock()))
        old_url = retired.enter_context(serve(_mock()))
        config.write_text(_policy_text(old_url))
        url = stack.enter_context(serve(create_app(config=config, watch=False)))
        assert _ask(url, "What is the capital of France?").status_code == 200
        assert _ask(url, "WHAT IS the capital of France?").headers["x-tokenweir-cache"] == (
            "semantic-hit"
        )
        config.write_text(_policy_text(new_url))  # the backend moves
        assert httpx.post(url + "/admin/reload", headers=admin).json()["status"] == "reloaded"
        retired.close()  # the old backend is gone
        first = _ask(url, "How tall is the Eiffel tower?")
        reworded = _ask(url, "HOW TALL is the Eiffel tower?")
        last = httpx.get(new_url + "/mock/stats").json()["last_request"]
    assert first.status_code == 200
    assert first.headers["x-tokenweir-cache"] == "miss"
    assert reworded.headers["x-tokenweir-cache"] == "semantic-hit"
    # The hit was confirmed by the new backend's reranker (its last request).
    assert last["documents"] == ["How tall is the Eiffel tower?"]
    assert last["query"] == "HOW TALL is the Eiffel tower?"


def _mock() -> mockbackend.MockBackend:
    return mockbackend.create_app(ttft_ms=0, tokens_per_second=2000)
