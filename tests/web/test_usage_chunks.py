"""The usage a backend reports, malformed or not readable as orjson reads JSON: what a client sees
and what the request bills, through a real gateway, the openai SDK as the client and a backend on
127.0.0.1 that answers honestly but sends whatever usage a test sets."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from proxy.app import create_app
from tests.conftest import ALPHA_KEY
from tests.servers import serve
from tests.web.lyingbackend import WORD, WORDS, LyingBackend, lying_backend
from tests.web.test_billing import HELLO, billing_policy, exact_output, ledger_records

# Usage chunks a backend may send malformed, each mentioning `prompt_tokens` as a usage chunk does.
MALFORMED = [
    b'"garbage", "note": {"prompt_tokens": 9}',  # usage no object
    b'[{"prompt_tokens": 9, "completion_tokens": 12}]',
    b'null, "prompt_tokens": 9',
    b'{"prompt_tokens": 9, "completion_tokens": NaN}',  # no JSON to orjson (nor to RFC 8259)
    b'{"prompt_tokens": 9, "completion_tokens": 12',  # cut short
]


@pytest.fixture
def liar_gateway(tmp_path: Path) -> Iterator[tuple[LyingBackend, str, Path]]:
    ledger = tmp_path / "ledger.db"
    with lying_backend() as (backend, url), serve(create_app(billing_policy(url, ledger))) as gw:
        yield backend, gw, ledger


def _client(gateway: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway + "/v1", api_key=ALPHA_KEY, max_retries=0, timeout=10)


@pytest.mark.parametrize("usage", MALFORMED)
def test_a_malformed_usage_chunk_never_reaches_a_client_that_did_not_ask_for_usage(
    liar_gateway: tuple[LyingBackend, str, Path], usage: bytes
) -> None:
    """The gateway asks the backend for usage on its own behalf: the chunk that answers, whatever
    its shape, is the gateway's. It reached the client (the SDK raised on the event that was no
    JSON, and saw a `usage` string or list it never asked for) and was billed as a token."""
    backend, gateway, ledger = liar_gateway
    backend.usage = usage
    stream = _client(gateway).chat.completions.create(
        model="exact-llm", messages=HELLO, stream=True
    )  # type: ignore[call-overload]
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == WORD * WORDS
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)  # no usage-only chunk, the malformed one included
    [record] = ledger_records(ledger, 1)
    assert (record.usage_source, record.output_tokens) == ("counted", WORDS)


@pytest.mark.parametrize("usage", MALFORMED[:3])
def test_a_malformed_usage_chunk_a_client_asked_for_is_passed_on_and_is_no_token(
    liar_gateway: tuple[LyingBackend, str, Path], usage: bytes
) -> None:
    backend, gateway, ledger = liar_gateway
    backend.usage = usage
    stream = _client(gateway).chat.completions.create(
        model="exact-llm",
        messages=HELLO,
        stream=True,
        stream_options={"include_usage": True},
    )  # type: ignore[call-overload]
    chunks = list(stream)
    assert [c for c in chunks if not c.choices]  # the backend's chunk, as it sent it
    [record] = ledger_records(ledger, 1)
    assert (record.usage_source, record.output_tokens) == ("counted", WORDS)


# Whole answers orjson refuses but the openai SDK (Python's json) reads: each usage unbelievable.
UNREADABLE_TO_ORJSON = [
    b'{"prompt_tokens": 9, "completion_tokens": NaN}',
    b'{"prompt_tokens": Infinity, "completion_tokens": 12}',
    b'{"prompt_tokens": 9, "completion_tokens": 1e400}',
    b'{"prompt_tokens": 9, "completion_tokens": 123456789012345678901234567890, "x": NaN}',
]


@pytest.mark.parametrize("usage", UNREADABLE_TO_ORJSON)
def test_a_whole_answer_the_client_can_read_is_relayed_and_billed_on_the_gateways_count(
    liar_gateway: tuple[LyingBackend, str, Path], usage: bytes
) -> None:
    """An answer whose usage held `NaN`, `Infinity` or a number past a double was a 502 that
    billed nothing, though the backend had made it and the client's own JSON reader takes it.
    It is relayed as it came; its usage, not believed, is the gateway's own count, as a
    stream's without usage is."""
    backend, gateway, ledger = liar_gateway
    backend.usage = usage
    answer = _client(gateway).chat.completions.create(model="exact-llm", messages=HELLO)
    assert answer.choices[0].message.content == WORD * WORDS
    [record] = ledger_records(ledger, 1)
    assert (record.status, record.usage_source) == (200, "counted")
    assert record.output_tokens == exact_output()
    assert record.input_tokens == record.counted_input_tokens > 0


def test_a_lone_surrogate_in_a_whole_answer_is_relayed_and_its_usage_believed(
    liar_gateway: tuple[LyingBackend, str, Path],
) -> None:
    backend, gateway, ledger = liar_gateway
    backend.usage = b'{"prompt_tokens": 9, "completion_tokens": 12, "note": "\\ud800"}'
    answer = _client(gateway).chat.completions.create(model="exact-llm", messages=HELLO)
    assert answer.choices[0].message.content == WORD * WORDS
    backend.usage = None  # and counted by the tokenizer where it is in the text
    whole = backend._whole
    backend._whole = lambda n: whole(n).replace(b"hello hello", b"hello \\ud800hello", 1)  # type: ignore[method-assign]
    answer = _client(gateway).chat.completions.create(model="exact-llm", messages=HELLO)
    assert answer.choices[0].message.content == WORD + "\ud800" + WORD * (WORDS - 1)
    believed, counted = ledger_records(ledger, 2)
    assert (believed.usage_source, believed.input_tokens, believed.output_tokens) == (
        "backend",
        9,
        12,
    )
    assert counted.usage_source == "counted"
    assert counted.output_tokens >= exact_output()


def test_a_whole_answer_that_is_no_json_at_all_stays_a_502_that_bills_nothing(
    liar_gateway: tuple[LyingBackend, str, Path],
) -> None:
    """No client could read it: not an answer, whatever the backend did to make it."""
    backend, gateway, ledger = liar_gateway
    backend.usage = b'{"prompt_tokens": 9, "completion_tokens": 12'  # the body cut short
    with pytest.raises(openai.APIStatusError) as failed:
        _client(gateway).chat.completions.create(model="exact-llm", messages=HELLO)
    assert failed.value.status_code == 502
    [record] = ledger_records(ledger, 1)
    assert (record.input_tokens, record.output_tokens, record.cost_nusd) == (0, 0, 0)


def test_a_usage_chunk_with_a_choice_nested_past_what_orjson_writes_is_relayed_and_billed(
    liar_gateway: tuple[LyingBackend, str, Path],
) -> None:
    """A usage chunk that also carries a choice is written again without its usage for a client
    that did not ask for it; a choice nested 300 levels deep (orjson reads 1,024, writes 254)
    raised there: a 500 that billed nothing, or a stream broken off."""
    backend, gateway, ledger = liar_gateway
    deep = b"[" * 300 + b"]" * 300
    usage_chunk = (
        b'data: {"id": "c1", "choices": [{"index": 0, "delta": {}, "finish_reason": null, '
        b'"logprobs": {"deep": ' + deep + b'}}], "usage": {"prompt_tokens": 9, '
        b'"completion_tokens": 12}}\n\n'
    )
    events = backend._events
    backend._events = lambda n: (  # type: ignore[method-assign]
        usage_chunk if b'"usage"' in event else event for event in events(n)
    )
    with httpx.stream(
        "POST",
        gateway + "/v1/chat/completions",
        json={"model": "exact-llm", "messages": HELLO, "stream": True},
        headers={"authorization": f"Bearer {ALPHA_KEY}"},
        timeout=10,
    ) as answer:
        assert answer.status_code == 200
        text = answer.read()
    assert text.count(b"hello") == WORDS
    assert b'"usage":null' in text
    assert deep in text
    assert text.endswith(b"data: [DONE]\n\n")
    [record] = ledger_records(ledger, 1)
    assert (record.usage_source, record.input_tokens, record.output_tokens) == ("backend", 9, 12)


def test_a_usage_chunk_written_again_keeps_a_big_integer_as_the_backend_wrote_it(
    liar_gateway: tuple[LyingBackend, str, Path],
) -> None:
    """A chunk with a choice and usage (vLLM's `continuous_usage_stats`), written again without
    its usage for a client that did not ask for it, wrote an integer past 64 bits in it as the
    nearest float (orjson reads it so)."""
    backend, gateway, _ = liar_gateway
    big = b"123456789012345678901234567890"
    usage_chunk = (
        b'data: {"id": "c1", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], '
        b'"usage": {"prompt_tokens": 9, "completion_tokens": 12}, "trace_id": ' + big + b"}\n\n"
    )
    events = backend._events
    backend._events = lambda n: (  # type: ignore[method-assign]
        usage_chunk if b'"usage"' in event else event for event in events(n)
    )
    stream = _client(gateway).chat.completions.create(
        model="exact-llm", messages=HELLO, stream=True
    )  # type: ignore[call-overload]
    chunks = list(stream)
    assert chunks[-1].usage is None
    assert chunks[-1].model_extra == {"trace_id": int(big)}


def test_a_stream_whose_first_event_a_client_can_read_is_relayed(
    liar_gateway: tuple[LyingBackend, str, Path],
) -> None:
    """A first event orjson refuses (a lone surrogate's escape) but the client's reader takes
    was a 502 before any byte, as a whole answer's was."""
    backend, gateway, ledger = liar_gateway
    events = backend._events
    backend._events = lambda n: (  # type: ignore[method-assign]
        event.replace(b'"content":""', b'"content":"\\ud83d"', 1) for event in events(n)
    )
    stream = _client(gateway).chat.completions.create(
        model="exact-llm", messages=HELLO, stream=True
    )  # type: ignore[call-overload]
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "\ud83d" + WORD * WORDS
    [record] = ledger_records(ledger, 1)
    assert (record.status, record.usage_source, record.output_tokens) == (200, "backend", 12)
