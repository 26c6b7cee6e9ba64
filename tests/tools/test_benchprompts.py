"""Bench workloads: tokenizers, synthetic prompt sizes, prompt files and request bodies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.tools.bench.config import BenchConfig, BenchError
from proxy.tools.bench.prompts import (
    WORDS,
    Tokenizer,
    build_workload,
    load_tokenizer,
    read_prompt_file,
    synthetic_prompts,
    tiktoken_tokenizer,
)


def byte_pair_tokenizer() -> Tokenizer:
    """A tiny tiktoken encoding made here (the real ones are downloaded on first use)."""
    tiktoken = pytest.importorskip("tiktoken")
    ranks = {bytes([i]): i for i in range(256)}
    for pair in (b"th", b"he", b"in", b"er", b"an", b" t", b" a"):
        ranks[pair] = len(ranks)
    encoding = tiktoken.Encoding(
        name="tiny", pat_str=r" ?\w+| ?[^\w\s]+|\s+", mergeable_ranks=ranks, special_tokens={}
    )
    return tiktoken_tokenizer(encoding)


def word_level_tokenizer(tmp_path: Path) -> Tokenizer:
    tokenizers = pytest.importorskip("tokenizers")
    words = {*WORDS, *"Write a long story that uses these words in this order".split()}
    vocab = {word: i for i, word in enumerate(["[UNK]", *sorted(words)])}
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf.decoder = tokenizers.decoders.WordPiece()
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    return load_tokenizer(str(path))


@pytest.mark.parametrize("input_tokens", [1, 7, 64, 512])
def test_synthetic_prompts_are_exact_with_tiktoken(input_tokens: int) -> None:
    tokenizer = byte_pair_tokenizer()
    prompts = synthetic_prompts(5, input_tokens, tokenizer, seed=3)
    assert [tokenizer.count(prompt) for prompt in prompts] == [input_tokens] * 5


def test_synthetic_prompts_are_exact_with_a_tokenizer_json(tmp_path: Path) -> None:
    tokenizer = word_level_tokenizer(tmp_path)
    assert tokenizer.name == "hf:tokenizer.json"
    prompts = synthetic_prompts(3, 300, tokenizer)
    assert [tokenizer.count(prompt) for prompt in prompts] == [300, 300, 300]


def test_synthetic_prompts_without_tokenizer_are_one_word_per_token() -> None:
    prompts = synthetic_prompts(4, 200, None, seed=1)
    assert [len(prompt.split()) for prompt in prompts] == [200] * 4
    assert len(set(prompts)) == 4, "distinct prompts, so a prefix cache cannot help later ones"
    assert prompts == synthetic_prompts(4, 200, None, seed=1)
    assert prompts != synthetic_prompts(4, 200, None, seed=2)


def test_unknown_tokenizers_are_clear_errors(tmp_path: Path) -> None:
    pytest.importorskip("tiktoken")
    with pytest.raises(BenchError, match="tiktoken encoding 'no_such_encoding'"):
        load_tokenizer("tiktoken:no_such_encoding")
    with pytest.raises(BenchError, match=r"neither tiktoken:NAME nor a tokenizer\.json"):
        load_tokenizer(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    pytest.importorskip("tokenizers")
    with pytest.raises(BenchError, match="cannot load tokenizer"):
        load_tokenizer(str(bad))


def test_prompt_file_of_text_lines_and_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text(
        'plain question\n\n{"prompt": "from json"}\n'
        '{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}\n',
        encoding="utf-8",
    )
    assert read_prompt_file(str(path)) == [
        [{"role": "user", "content": "plain question"}],
        [{"role": "user", "content": "from json"}],
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
    ]


def test_prompt_file_errors_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": \n', encoding="utf-8")
    with pytest.raises(BenchError, match=r"p.jsonl:2: invalid JSON"):
        read_prompt_file(str(path))
    path.write_text('{"text": "no prompt key"}\n', encoding="utf-8")
    with pytest.raises(BenchError, match=r"p.jsonl:1: .*'prompt' or a 'messages'"):
        read_prompt_file(str(path))
    path.write_text("\n\n", encoding="utf-8")
    with pytest.raises(BenchError, match="no prompts"):
        read_prompt_file(str(path))


def test_stream_bodies_ask_for_usage_and_carry_extra_fields() -> None:
    config = BenchConfig(
        base_url="http://h", model="m", requests=3, max_tokens=7, extra_body={"ignore_eos": True}
    )
    workload = build_workload(config, None)
    body = orjson.loads(workload.bodies[0])
    assert body["model"] == "m"
    assert body["max_tokens"] == 7
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True
    assert "estimated" in workload.prompt_note
    assert len(workload.bodies) == 3 * 4, "one distinct prompt per request across all levels"


def test_the_note_says_when_a_run_sends_prompts_again(tmp_path: Path) -> None:
    def note(**fields: Any) -> str:
        config = BenchConfig(base_url="http://h", model="m", concurrency=(64,), **fields)
        return build_workload(config, None).prompt_note

    assert "again" not in note(requests=4096)
    assert "; 5000 requests over 4096 distinct prompts sends some again" in note(requests=5000)
    assert "; a timed run may send its 4096 distinct prompts again" in note(duration_s=10.0)
    path = tmp_path / "p.txt"
    path.write_text("one\ntwo\n", encoding="utf-8")
    assert note(requests=2, prompt_file=str(path)) == f"2 prompts from {path}"
    assert note(requests=3, prompt_file=str(path)).endswith(
        "; 3 requests over 2 distinct prompts sends some again (a cache may answer them)"
    )


def test_non_stream_bodies_have_no_stream_options(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_text("one\ntwo\n", encoding="utf-8")
    config = BenchConfig(base_url="http://h", model="m", stream=False, prompt_file=str(path))
    workload = build_workload(config, None)
    assert len(workload.bodies) == 2
    body = orjson.loads(workload.bodies[1])
    assert body["stream"] is False
    assert "stream_options" not in body
    assert body["messages"] == [{"role": "user", "content": "two"}]
