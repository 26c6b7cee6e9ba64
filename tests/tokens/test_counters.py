"""Specs in the policy, counters loaded once at startup, long counts off the event loop."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import proxy.tokens
from proxy.policy import Policy, parse_policy
from proxy.tokens import TokenCounters, TokenizerError, load_counter
from proxy.tokens import hf as hf_adapter
from tests.shared import offline_tiktoken, tokenizer_file
from tests.tokens import CORPUS

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module", autouse=True)
def tiktoken_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with offline_tiktoken(tmp_path_factory.mktemp("tiktoken")) as cache_dir:
        yield cache_dir


@pytest.fixture(scope="module")
def policy() -> Policy:
    qwen = tokenizer_file("qwen2.5/qwen.tiktoken")
    llama = tokenizer_file("llama-3/tokenizer.json")
    return parse_policy(
        f"""
backends:
  - name: vllm
    url: http://127.0.0.1:9/v1
    models: [qwen2.5-7b-instruct, qwen-copy, llama-3.2-3b, gpt-4o, unknown-tokenizer]
models:
  qwen2.5-7b-instruct: {{tokenizer: "{qwen}"}}
  qwen-copy: {{tokenizer: "{qwen}"}}
  llama-3.2-3b: {{tokenizer: "hf:{llama}"}}
  gpt-4o: {{tokenizer: "tiktoken:o200k_base"}}
  unknown-tokenizer: {{}}
tenants: {{}}
""",
        environ={},
    )


@pytest.fixture(scope="module")
def counters(policy: Policy) -> TokenCounters:
    return TokenCounters(policy)


def test_every_model_gets_its_counter_and_shares_loaded_tokenizers(
    counters: TokenCounters,
) -> None:
    names = counters.names()
    assert names["qwen2.5-7b-instruct"].endswith("qwen.tiktoken#qwen2.5")
    assert names["llama-3.2-3b"].startswith("hf:/")
    assert names["gpt-4o"] == "tiktoken:o200k_base"
    assert names["unknown-tokenizer"] == "estimate"
    assert counters.for_model("qwen-copy") is counters.for_model("qwen2.5-7b-instruct")
    assert counters.for_model("not-in-the-policy").name == "estimate"


async def test_async_counts_equal_the_counters_own(counters: TokenCounters) -> None:
    chat = [{"role": "user", "content": "你好"}]
    for model in ("qwen2.5-7b-instruct", "llama-3.2-3b", "gpt-4o", "unknown-tokenizer"):
        counter = counters.for_model(model)
        assert await counters.count_chat(model, chat) == counter.count_chat(chat)
        assert await counters.count_prompt(model, "hello") == counter.count_prompt("hello")
    assert await counters.count_chat("qwen2.5-7b-instruct", chat) == 30


async def test_a_long_count_runs_off_the_event_loop(counters: TokenCounters) -> None:
    """Other tasks keep running while a long text is counted: a ticker ticks during each
    count (a count on the loop would let it tick not once before returning). Order, not
    milliseconds: a loaded machine slows the ticker and the count alike."""
    text = "\n".join(CORPUS) * 500
    model = "llama-3.2-3b"  # Hugging Face: the slowest tokenizer here
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.001)
            ticks += 1

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.01)
    during: list[int] = []
    try:
        before = ticks
        chat_tokens = await counters.count_chat(model, [{"role": "user", "content": text}])
        during.append(ticks - before)
        before = ticks
        prompt_tokens = await counters.count_prompt(model, text)
        during.append(ticks - before)
    finally:
        ticker.cancel()
    assert chat_tokens > prompt_tokens > 100_000
    assert min(during) >= 3, f"the event loop ticked only {during} times during the counts"


def test_relative_paths_resolve_against_base_dir() -> None:
    tokenizers_dir = tokenizer_file("qwen2.5").parent
    counter = load_counter("qwen2.5/qwen.tiktoken", model="q", base_dir=tokenizers_dir)
    assert counter.name == f"tiktoken:{tokenizers_dir}/qwen2.5/qwen.tiktoken#qwen2.5"
    by_dir = load_counter("hf:llama-3", model="l", base_dir=tokenizers_dir)
    assert by_dir.name == f"hf:{tokenizers_dir}/llama-3/tokenizer.json"


def test_hub_ids_go_to_the_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []

    def fetch(repo: str, filename: str, revision: str | None) -> Path | None:
        asked.append(repo)
        return tokenizer_file("llama-3/tokenizer.json") if filename == "tokenizer.json" else None

    monkeypatch.setattr(hf_adapter, "hub_fetch", fetch)
    counter = load_counter("hf:meta-llama/Llama-3.2-3B-Instruct", model="l")
    assert counter.name == "hf:meta-llama/Llama-3.2-3B-Instruct"
    assert asked[0] == "meta-llama/Llama-3.2-3B-Instruct"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("/nowhere/tokenizer.json", "no such file or directory: /nowhere/tokenizer.json"),
        ("tiktoken:o200k_base#qwen2", "#FORMAT applies to files"),
        ("hf:{llama}#vicuna", "unknown chat format #vicuna; built in: #chatml"),
        ("{qwen}#mistral", "unknown tokenizer family #mistral"),
    ],
)
def test_bad_specs_name_the_model_and_the_problem(spec: str, message: str) -> None:
    spec = spec.format(
        llama=tokenizer_file("llama-3/tokenizer.json"),
        qwen=tokenizer_file("qwen2.5/qwen.tiktoken"),
    )
    with pytest.raises(TokenizerError, match=f"model 'm': tokenizer '.*': {message}"):
        load_counter(spec, model="m")


def test_a_startup_with_a_bad_spec_fails_with_it() -> None:
    policy = parse_policy(
        """
backends: [{name: b, url: "http://127.0.0.1:9/v1", models: [m]}]
models: {m: {tokenizer: "tiktoken:nope"}}
tenants: {}
""",
        environ={},
    )
    with pytest.raises(TokenizerError, match="model 'm': tokenizer 'tiktoken:nope'"):
        TokenCounters(policy)


def test_a_missing_package_names_it_and_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """It said `pip install 'tokenweir[tokenizers]'`: no such extra (tiktoken and tokenizers are
    tokenweir's own dependencies), so pip warned and installed nothing."""
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    monkeypatch.delitem(sys.modules, "proxy.tokens.tiktoken_counter", raising=False)
    monkeypatch.delattr(proxy.tokens, "tiktoken_counter", raising=False)
    with pytest.raises(TokenizerError) as caught:
        load_counter("tiktoken:o200k_base", model="m")
    assert str(caught.value).endswith("needs the tiktoken package: pip install tiktoken")
