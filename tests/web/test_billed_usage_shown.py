"""What a client reads as usage is what it was billed: where the gateway does not believe a
backend's usage (missing, malformed, out of bounds) and bills its own counts, the answer shows
those counts, through a real gateway, the openai and anthropic SDKs and backends on 127.0.0.1
that answer honestly but send whatever usage a test sets. A believed usage goes out untouched."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionChunk

from proxy.app import create_app
from tests.conftest import ALPHA_KEY
from tests.servers import serve
from tests.web.lyingbackend import WORD, WORDS, LyingBackend, lying_backend
from tests.web.test_agent_usage_checks import BAD, KEY, QUESTION, UsageLiar, billed
from tests.web.test_agent_usage_checks import setup as setup
from tests.web.test_billing import (
    BAD_USAGE,
    HELLO,
    billing_policy,
    exact_output,
    ledger_records,
)
from tests.web.test_usage_chunks import MALFORMED

AUTH = {"authorization": f"Bearer {ALPHA_KEY}"}
# Not believed, each for another reason: missing, more than the bound, a float, malformed.
NOT_BELIEVED = [None, BAD_USAGE[0], BAD_USAGE[3], *MALFORMED[:3]]


@pytest.fixture(scope="module")
def liar_gateway(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[LyingBackend, str, Path]]:
    ledger = Path(tmp_path_factory.mktemp("shown")) / "ledger.db"
    with lying_backend() as (backend, url), serve(create_app(billing_policy(url, ledger))) as gw:
        yield backend, gw, ledger


def _openai(url: str, key: str = ALPHA_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=10)


def _billed(ledger: Path, request_id: str) -> tuple[int, int]:
    input_tokens, output_tokens, _ = billed(ledger, request_id)
    return input_tokens, output_tokens


def _streamed_asking_usage(gateway: str, n: int) -> tuple[list[ChatCompletionChunk], str]:
    """The chunks of a chat stream of `n` answers that asks for usage, and its request id."""
    raw = _openai(gateway).chat.completions.with_raw_response.create(
        model="exact-llm",
        messages=HELLO,
        n=n,
        stream=True,
        stream_options={"include_usage": True},
    )
    return list(raw.parse()), raw.headers["x-request-id"]


@pytest.mark.parametrize("usage", NOT_BELIEVED)
def test_a_whole_chat_answer_shows_the_usage_billed(
    liar_gateway: tuple[LyingBackend, str, Path], usage: bytes | None
) -> None:
    backend, gateway, ledger = liar_gateway
    backend.usage = usage
    raw = _openai(gateway).chat.completions.with_raw_response.create(
        model="exact-llm", messages=HELLO, n=2
    )
    answer = raw.parse()
    assert [c.message.content for c in answer.choices] == [WORD * WORDS] * 2
    assert answer.usage is not None
    shown = (answer.usage.prompt_tokens, answer.usage.completion_tokens)
    assert shown == _billed(ledger, raw.headers["x-request-id"])
    assert answer.usage.total_tokens == sum(shown)
    assert ledger_records(ledger, 1)[-1].usage_source == "counted"


@pytest.mark.parametrize("usage", NOT_BELIEVED)
@pytest.mark.parametrize("n", [1, 2])
def test_a_streams_usage_chunk_shows_the_usage_billed(
    liar_gateway: tuple[LyingBackend, str, Path], usage: bytes | None, n: int
) -> None:
    """Held back until the request is billed, then sent before [DONE] with the bill (a chunk
    of the gateway's own where the backend sent none, or none the SDK could read)."""
    backend, gateway, ledger = liar_gateway
    backend.usage = usage
    chunks, request_id = _streamed_asking_usage(gateway, n)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == WORD * WORDS * n
    [last] = [c for c in chunks if not c.choices]
    assert last is chunks[-1]
    assert last.usage is not None
    shown = (last.usage.prompt_tokens, last.usage.completion_tokens)
    assert shown == _billed(ledger, request_id) == (shown[0], WORDS * n)


def test_several_answers_show_the_output_the_gateway_counted_and_billed(
    liar_gateway: tuple[LyingBackend, str, Path],
) -> None:
    """A backend that reports one choice of two (llama.cpp) is billed the gateway's larger
    output count; the client reads that count, whole or streamed."""
    backend, gateway, ledger = liar_gateway
    backend.usage = b'{"prompt_tokens": 9, "completion_tokens": 12}'
    client = _openai(gateway)
    whole = client.chat.completions.with_raw_response.create(model="exact-llm", messages=HELLO, n=2)
    usage = whole.parse().usage
    assert usage is not None
    billed_whole = _billed(ledger, whole.headers["x-request-id"])
    assert (usage.prompt_tokens, usage.completion_tokens) == billed_whole == (9, exact_output(2))
    streamed = client.chat.completions.with_raw_response.create(
        model="exact-llm", messages=HELLO, n=2, stream=True, stream_options={"include_usage": True}
    )
    usage = list(streamed.parse())[-1].usage
    assert usage is not None
    billed_stream = _billed(ledger, streamed.headers["x-request-id"])
    assert (usage.prompt_tokens, usage.completion_tokens) == billed_stream
    assert billed_stream[1] > 12  # its lower bound: the token events, less two a choice


def test_a_believed_usage_goes_out_as_the_backend_sent_it(
    liar_gateway: tuple[LyingBackend, str, Path],
) -> None:
    """The usual answer: its bytes untouched, with its length; a stream's usage chunk as sent."""
    backend, gateway, ledger = liar_gateway
    backend.usage = b'{"prompt_tokens": 9, "completion_tokens": 12, "extra": 123456789012345678901}'
    payload = {"model": "exact-llm", "messages": HELLO}
    url = gateway + "/v1/chat/completions"
    answer = httpx.post(url, json=payload, headers=AUTH, timeout=10)
    assert answer.headers["content-length"] == str(len(answer.content))
    assert answer.content == backend._whole(1)
    stream = httpx.post(
        url,
        json={**payload, "stream": True, "stream_options": {"include_usage": True}},
        headers=AUTH,
        timeout=10,
    )
    assert b'"usage": ' + backend.usage + b"}\n\n" in stream.content
    assert _billed(ledger, stream.headers["x-request-id"]) == (9, 12)


def test_a_rejected_usage_leaves_the_rest_of_the_answer_as_the_backend_wrote_it(
    liar_gateway: tuple[LyingBackend, str, Path],
) -> None:
    """An integer past 64 bits elsewhere in the answer stays exact (orjson reads it as a float),
    and an answer only Python's reader takes (a lone surrogate) keeps its every other byte."""
    backend, gateway, ledger = liar_gateway
    big = b"123456789012345678901234567890"
    backend.usage = b'{"prompt_tokens": 9, "completion_tokens": 12.5}, "seed": ' + big
    answer = httpx.post(
        gateway + "/v1/chat/completions",
        json={"model": "exact-llm", "messages": HELLO},
        headers=AUTH,
        timeout=10,
    )
    assert b'"seed":' + big in answer.content
    shown = answer.json()["usage"]
    assert (shown["prompt_tokens"], shown["completion_tokens"]) == _billed(
        ledger, answer.headers["x-request-id"]
    )
    backend.usage = b'{"prompt_tokens": NaN, "completion_tokens": 12}, "note": "\\ud800"'
    answer = httpx.post(
        gateway + "/v1/chat/completions",
        json={"model": "exact-llm", "messages": HELLO},
        headers=AUTH,
        timeout=10,
    )
    assert answer.content.endswith(b', "note": "\\ud800"}')
    assert answer.content.startswith(backend._whole(1).split(b'"usage"')[0])
    shown = answer.json()["usage"]
    assert (shown["prompt_tokens"], shown["completion_tokens"]) == _billed(
        ledger, answer.headers["x-request-id"]
    )


@pytest.mark.parametrize("usage", [*BAD, {}, None])
def test_a_messages_answer_shows_the_usage_billed(
    setup: tuple[UsageLiar, str, Path],
    usage: dict[str, object] | None,
) -> None:
    """Not believed, empty, or missing (a message_delta without usage)."""
    liar, url, ledger = setup
    liar.start_usage, liar.usage = {}, usage
    client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
    with client:
        raw = client.messages.with_raw_response.create(
            model="exact-llm", max_tokens=50, messages=QUESTION
        )
        whole = raw.parse()
        with client.messages.stream(model="exact-llm", max_tokens=50, messages=QUESTION) as stream:
            request_id = stream.response.headers["x-request-id"]
            assert "".join(stream.text_stream) == "hello" * 12
            final = stream.get_final_message()
    for message, rid in [(whole, raw.headers["x-request-id"]), (final, request_id)]:
        shown = message.usage
        cache = (shown.cache_creation_input_tokens or 0) + (shown.cache_read_input_tokens or 0)
        assert (shown.input_tokens + cache, shown.output_tokens) == _billed(ledger, rid)


@pytest.mark.parametrize(
    "usage", [u for u in BAD if "cache_read_input_tokens" not in u] + [{}, None]
)
def test_a_responses_answer_shows_the_usage_billed(
    setup: tuple[UsageLiar, str, Path],
    usage: dict[str, object] | None,
) -> None:
    """Not believed, empty, or missing (`usage: null`)."""
    liar, url, ledger = setup
    liar.usage = usage
    client = _openai(url, KEY)
    raw = client.responses.with_raw_response.create(model="exact-llm", input=QUESTION)
    streamed = client.responses.with_raw_response.create(
        model="exact-llm", input=QUESTION, stream=True
    )
    events = list(streamed.parse())
    assert events[-1].type == "response.completed"
    for response, answer in [(raw.parse(), raw), (events[-1].response, streamed)]:
        assert response.output_text == "hello " * 12
        assert response.usage is not None
        shown = (response.usage.input_tokens, response.usage.output_tokens)
        assert shown == _billed(ledger, answer.headers["x-request-id"])
        assert response.usage.total_tokens == sum(shown)


def test_count_tokens_says_the_input_a_request_is_billed_without_backend_usage(
    setup: tuple[UsageLiar, str, Path],
) -> None:
    """`count_tokens` and the bill of a request whose backend reports no usage count the same
    input (the tenant's system prompt, the tools, the system given), and the answer shows it."""
    liar, url, ledger = setup
    liar.start_usage, liar.usage = {}, {}
    tools = [{"name": "weather", "input_schema": {"type": "object", "properties": {}}}]
    client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
    with client:
        for extra in [{}, {"system": "Be terse."}, {"tools": tools}]:
            counted = client.messages.count_tokens(model="exact-llm", messages=QUESTION, **extra)
            raw = client.messages.with_raw_response.create(
                model="exact-llm", max_tokens=50, messages=QUESTION, **extra
            )
            assert raw.parse().usage.input_tokens == counted.input_tokens
            assert _billed(ledger, raw.headers["x-request-id"])[0] == counted.input_tokens


@pytest.mark.parametrize(
    ("usage", "n"),
    [(BAD_USAGE[0], 1), (b'"garbage"', 1), (b'{"prompt_tokens": 9, "completion_tokens": 12}', 2)],
)
def test_usage_in_a_chunk_with_choices_is_shown_as_billed_at_the_end(
    liar_gateway: tuple[LyingBackend, str, Path], usage: bytes, n: int
) -> None:
    """llama.cpp sends usage in its last chunk, beside the finish: one not believed, or short of
    what two answers billed, reached the client as it came. That chunk goes on without it, and
    a usage chunk of the bill ends the stream."""
    backend, gateway, ledger = liar_gateway
    backend.usage = usage
    events = backend._events

    def finish_with_usage(n: int) -> Iterator[bytes]:
        for event in events(n):
            if b'"finish_reason":"stop"' in event and event.find(b'"index":%d' % (n - 1)) >= 0:
                yield event[: -len(b"}\n\n")] + b', "usage": ' + usage + b"}\n\n"
            elif b'"usage"' not in event:
                yield event

    backend._events = finish_with_usage  # type: ignore[method-assign]
    chunks, request_id = _streamed_asking_usage(gateway, n)
    assert [c.usage is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
    last = chunks[-1]
    assert not last.choices
    assert last.usage is not None
    shown = (last.usage.prompt_tokens, last.usage.completion_tokens)
    assert shown == _billed(ledger, request_id)


UNDER_REPORTED = {"input_tokens": 9, "output_tokens": 1}  # believable, but 12 words streamed


def test_a_messages_stream_that_under_reports_its_output_shows_the_output_billed(
    setup: tuple[UsageLiar, str, Path],
) -> None:
    """Its message_delta went out as the backend wrote it (1 output token) while the ledger
    billed the 12 text deltas the gateway relayed (`counted_output`)."""
    liar, url, ledger = setup
    liar.start_usage, liar.usage = {}, UNDER_REPORTED
    client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
    with (
        client,
        client.messages.stream(model="exact-llm", max_tokens=50, messages=QUESTION) as stream,
    ):
        request_id = stream.response.headers["x-request-id"]
        assert "".join(stream.text_stream) == "hello" * 12
        final = stream.get_final_message()
    input_tokens, output_tokens, source = billed(ledger, request_id)
    assert (source, output_tokens) == ("counted_output", 12)
    assert (final.usage.input_tokens, final.usage.output_tokens) == (input_tokens, output_tokens)


def test_a_responses_stream_that_under_reports_its_output_shows_the_output_billed(
    setup: tuple[UsageLiar, str, Path],
) -> None:
    liar, url, ledger = setup
    liar.usage = {**UNDER_REPORTED, "total_tokens": 10}
    streamed = _openai(url, KEY).responses.with_raw_response.create(
        model="exact-llm", input=QUESTION, stream=True
    )
    events = list(streamed.parse())
    assert events[-1].type == "response.completed"
    usage = events[-1].response.usage
    assert usage is not None
    input_tokens, output_tokens, source = billed(ledger, streamed.headers["x-request-id"])
    assert (source, output_tokens) == ("counted_output", 12)
    assert (usage.input_tokens, usage.output_tokens) == (input_tokens, output_tokens)


# A Responses usage that contradicts itself: OpenAI's and vLLM's total is input + output, and a
# cached or reasoning count is a part of its whole. Which number lies cannot be known.
CONTRADICTING = [
    {"input_tokens": 9, "output_tokens": 12, "total_tokens": 5},
    {"input_tokens": 9, "output_tokens": 12, "input_tokens_details": {"cached_tokens": -5}},
    {"input_tokens": 9, "output_tokens": 12, "input_tokens_details": {"cached_tokens": 900}},
    {"input_tokens": 9, "output_tokens": 12, "output_tokens_details": {"reasoning_tokens": 99}},
    {"input_tokens": 9, "output_tokens": 12, "output_tokens_details": {"reasoning_tokens": "x"}},
    {"input_tokens": 9, "output_tokens": 12, "output_tokens_details": 5},
]


@pytest.mark.parametrize("usage", CONTRADICTING)
def test_a_responses_usage_that_contradicts_itself_is_not_shown_or_billed(
    setup: tuple[UsageLiar, str, Path],
    usage: dict[str, object],
) -> None:
    """The answer showed it as the backend sent it (a total of 5 beside a bill of 21, a cached
    count of 900 out of 9), and the bill was its input and output: now the gateway's own exact
    counts are the bill, shown in its place, whole or streamed."""
    liar, url, ledger = setup
    liar.usage = usage
    client = _openai(url, KEY)
    raw = client.responses.with_raw_response.create(model="exact-llm", input=QUESTION)
    streamed = client.responses.with_raw_response.create(
        model="exact-llm", input=QUESTION, stream=True
    )
    events = list(streamed.parse())
    for response, answer in [(raw.parse(), raw), (events[-1].response, streamed)]:
        assert response.usage is not None
        shown = response.usage.model_dump()
        assert billed(ledger, answer.headers["x-request-id"])[2] == "counted"
        assert (shown["input_tokens"], shown["output_tokens"]) == _billed(
            ledger, answer.headers["x-request-id"]
        )
        assert shown["total_tokens"] == shown["input_tokens"] + shown["output_tokens"]
        assert shown["input_tokens_details"]["cached_tokens"] == 0
        assert shown["output_tokens_details"]["reasoning_tokens"] == 0


@pytest.mark.parametrize(
    "usage",
    [
        {"input_tokens": 9, "output_tokens": 12, "total_tokens": 21},
        {
            "input_tokens": 9,
            "output_tokens": 12,
            "total_tokens": 21,
            "input_tokens_details": {"cached_tokens": 9},
            "output_tokens_details": {"reasoning_tokens": 12},
        },
    ],
)
def test_a_consistent_responses_usage_goes_out_untouched(
    setup: tuple[UsageLiar, str, Path],
    usage: dict[str, object],
) -> None:
    liar, url, ledger = setup
    liar.usage = usage
    raw = _openai(url, KEY).responses.with_raw_response.create(model="exact-llm", input=QUESTION)
    assert raw.parse().usage.model_dump(exclude_none=True) == usage  # type: ignore[union-attr]
    assert billed(ledger, raw.headers["x-request-id"]) == (9, 12, "backend")
