"""Cache identity: the tenant is a hard part of every key; only deterministic requests qualify."""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from proxy.cache.key import cache_key
from proxy.policy.model import CacheSpec

EXACT = CacheSpec(mode="exact")
SEMANTIC = CacheSpec(mode="semantic")


def chat(*messages: dict[str, Any], **params: Any) -> dict[str, Any]:
    return {"model": "m", "messages": list(messages), "temperature": 0, **params}


USER = {"role": "user", "content": "What is the capital of France?"}


def test_colliding_tenant_names_get_different_keys() -> None:
    one = cache_key("a:b", "m", "chat", chat(USER), SEMANTIC)
    two = cache_key("a", "b:m", "chat", chat(USER), SEMANTIC)
    assert one is not None
    assert two is not None
    assert one.exact != two.exact
    assert one.partition != two.partition


def test_delivery_fields_do_not_change_the_key_but_output_fields_do() -> None:
    base = cache_key("t", "m", "chat", chat(USER), EXACT)
    same = cache_key("t", "m", "chat", chat(USER, stream=True, user="u", temperature=0.0), EXACT)
    assert base is not None
    assert same is not None
    assert base.exact == same.exact
    for change in ({"max_tokens": 5}, {"tools": [{"type": "function"}]}, {"top_p": 0.5}):
        other = cache_key("t", "m", "chat", chat(USER, **change), EXACT)
        assert other is not None
        assert other.exact != base.exact


def test_sampled_multi_choice_and_logprob_requests_are_not_cached() -> None:
    assert cache_key("t", "m", "chat", chat(USER, temperature=0.8), EXACT) is None
    assert cache_key("t", "m", "chat", {"model": "m", "messages": [USER]}, EXACT) is None
    assert cache_key("t", "m", "chat", chat(USER, n=2), EXACT) is None
    assert cache_key("t", "m", "chat", chat(USER, logprobs=True), EXACT) is None
    assert cache_key("t", "m", "chat", chat(USER, temperature=0.8, seed=3), EXACT) is not None
    always = CacheSpec(mode="always")
    assert cache_key("t", "m", "chat", chat(USER, temperature=0.8), always) is not None
    assert cache_key("t", "m", "embeddings", {"input": "x"}, always) is None


def test_the_partition_is_the_context_without_the_last_question() -> None:
    system = {"role": "system", "content": "Be brief."}
    one = cache_key("t", "m", "chat", chat(system, USER), SEMANTIC)
    reworded = {"role": "user", "content": "France's capital?"}
    two = cache_key("t", "m", "chat", chat(system, reworded), SEMANTIC)
    other_context = cache_key("t", "m", "chat", chat(USER), SEMANTIC)
    assert one is not None
    assert two is not None
    assert other_context is not None
    assert one.partition == two.partition != other_context.partition
    assert one.exact != two.exact
    assert (one.question, two.question) == (USER["content"], "France's capital?")


def test_semantic_needs_temperature_zero_and_a_user_question_last() -> None:
    seeded = cache_key("t", "m", "chat", chat(USER, temperature=0.5, seed=1), SEMANTIC)
    assert seeded is not None
    assert seeded.partition is None
    assistant_last = chat(USER, {"role": "assistant", "content": "Paris."})
    found = cache_key("t", "m", "chat", assistant_last, SEMANTIC)
    assert found is not None
    assert found.partition is None
    parts = {"role": "user", "content": [{"type": "text", "text": "Hi"}]}
    found = cache_key("t", "m", "chat", chat(parts), SEMANTIC)
    assert found is not None
    assert found.question == "Hi"


def test_the_exact_key_is_the_documented_digest_every_time() -> None:
    """SHA-256 over the version, the length-prefixed tenant, model and operation, and the
    canonical body: entries stored by an earlier gateway are found again (the prefix state is
    made once and copied, never shared between tenants)."""

    def expected(tenant: str, model: str, body: dict[str, Any]) -> str:
        parts = [b"tw-cache-v1\0"]
        for part in (tenant.encode(), model.encode(), b"chat"):
            parts += [len(part).to_bytes(4, "big"), part]
        kept = {k: v for k, v in body.items() if k != "model"}
        parts.append(orjson.dumps(kept, option=orjson.OPT_SORT_KEYS))
        return hashlib.sha256(b"".join(parts)).hexdigest()[:40]

    for tenant, question in [("a", "one"), ("b", "one"), ("a", "two"), ("a", "one")]:
        body = chat({"role": "user", "content": question})
        key = cache_key(tenant, "m", "chat", body, EXACT)
        assert key is not None
        assert key.exact == expected(tenant, "m", body), (tenant, question)


def test_the_same_json_value_is_one_key_and_different_text_another() -> None:
    """Escapes are how a client wrote the JSON, not what it says (`\\u00e9` is é, `\\/` is /):
    one key. NFC and NFD spell café with other code points, which most tokenizers read as
    other tokens (Llama 3's: 2 and 3), so the model may answer otherwise: two keys."""

    def key(raw_content: bytes) -> str:
        body = orjson.loads(b'{"model":"m","temperature":0,"messages":[{"role":"user","content":'
                            + raw_content + b"}]}")  # fmt: skip
        found = cache_key("t", "m", "chat", body, EXACT)
        assert found is not None
        return found.exact

    assert key('"café/😀"'.encode()) == key(b'"caf\\u00e9\\/\\ud83d\\ude00"')
    assert key('"café/😀"'.encode()) == key(b'"caf\\u00E9/\\uD83D\\uDE00"')
    assert key('"café"'.encode()) != key('"cafe\u0301"'.encode())
