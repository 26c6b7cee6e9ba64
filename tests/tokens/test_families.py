"""Qwen and Llama 3 tiktoken-format files: published ids, and the same ids as Hugging Face."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tiktoken
import tokenizers

from proxy.tokens import TokenizerError, load_counter
from proxy.tokens.tiktoken_counter import encoding_from_file
from tests.shared import tokenizer_file
from tests.tokens import CORPUS

SPECIAL_TEXTS = (
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "<|python_tag|>call()<|eom_id|><|reserved_special_token_7|>",
)


@pytest.fixture(scope="module")
def qwen() -> tiktoken.Encoding:
    encoding, family = encoding_from_file(tokenizer_file("qwen2.5/qwen.tiktoken"), None)
    assert family.name == "qwen2.5"
    return encoding


@pytest.fixture(scope="module")
def llama() -> tiktoken.Encoding:
    encoding, family = encoding_from_file(tokenizer_file("llama-3/tokenizer.model"), None)
    assert family.name == "llama3.1"
    return encoding


@pytest.fixture(scope="module")
def llama_hf() -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(tokenizer_file("llama-3/tokenizer.json")))


def test_qwen_published_ids(qwen: tiktoken.Encoding) -> None:
    assert qwen.encode("Hello, world!") == [9707, 11, 1879, 0]
    assert qwen.encode("hello world") == [14990, 1879]


def test_qwen_special_tokens_are_one_token_each(qwen: tiktoken.Encoding) -> None:
    text = "<|im_start|>user\n你好<|im_end|>\n<tool_call>x</tool_call><|endoftext|>"
    ids = qwen.encode(text, allowed_special="all")
    assert ids[0] == 151644
    assert {151643, 151645} <= set(ids)
    assert {151657, 151658} <= set(ids)


def test_qwen_counts_normalise_to_nfc_as_its_hugging_face_tokenizer_does() -> None:
    counter = load_counter(str(tokenizer_file("qwen2.5/qwen.tiktoken")), model="qwen")
    assert counter.count_text("cafe\u0301 re\u0301sume\u0301") == counter.count_text("café résumé")


def test_llama_tiktoken_file_and_tokenizer_json_give_the_same_ids(
    llama: tiktoken.Encoding, llama_hf: tokenizers.Tokenizer
) -> None:
    assert llama.encode("hello world") == [15339, 1917]
    assert llama_hf.encode("hello world").ids == [128000, 15339, 1917]
    for text in (*CORPUS, *SPECIAL_TEXTS):
        expected = llama_hf.encode(text, add_special_tokens=False).ids
        assert llama.encode(text, allowed_special="all") == expected, text


def test_llama_special_tokens_match_the_release() -> None:
    config = json.loads(tokenizer_file("llama-3/tokenizer_config.json").read_text())
    released = {int(k): v["content"] for k, v in config["added_tokens_decoder"].items()}
    _, family = encoding_from_file(tokenizer_file("llama-3/tokenizer.model"), None)
    built_in = {token_id: text for text, token_id in family.special_tokens}
    assert built_in == {k: v for k, v in released.items() if k < 128256}


def test_both_llama_counters_agree_on_counts_and_chats() -> None:
    model = load_counter(str(tokenizer_file("llama-3/tokenizer.model")), model="llama")
    json_file = load_counter(str(tokenizer_file("llama-3/tokenizer.json")), model="llama")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": CORPUS[3]}]
    for text in CORPUS:
        assert model.count_text(text) == json_file.count_text(text)
    assert model.count_chat(chat) == json_file.count_chat(chat)
    assert model.count_prompt("hello world") == json_file.count_prompt("hello world") == 3


def test_a_named_family_overrides_the_default() -> None:
    path = tokenizer_file("llama-3/tokenizer.model")
    counter = load_counter(f"{path}#llama3", model="llama")
    assert counter.name.endswith("#llama3")


def test_a_family_of_another_size_is_refused() -> None:
    path = tokenizer_file("llama-3/tokenizer.model")
    with pytest.raises(TokenizerError, match=r"#qwen2\.5 has 151643 ranks, this file has 128000"):
        load_counter(f"{path}#qwen2.5", model="llama")


def test_an_unknown_vocabulary_asks_for_a_family(tmp_path: Path) -> None:
    path = tmp_path / "tiny.tiktoken"
    path.write_text("YQ== 0\nYg== 1\nYWI= 2\n")
    with pytest.raises(TokenizerError, match="3 ranks matches no built-in family; name one"):
        load_counter(str(path), model="tiny")


def test_a_file_of_another_format_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.model"
    path.write_bytes(b"\x0a\x0b\x00sentencepiece")
    with pytest.raises(TokenizerError, match="not a tiktoken ranks file"):
        load_counter(str(path), model="llama2")
