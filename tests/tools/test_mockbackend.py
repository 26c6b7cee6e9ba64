"""The mock backend over real HTTP, as the openai SDK and a raw SSE reader see it."""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import time
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from proxy.clock import FakeClock
from proxy.tools.mock.backend import create_app
from proxy.tools.mock.stream import Outcome, Schedule, SseFormat, StreamRun, Ticker
from proxy.tools.mock.text import TokenSource
from tests.servers import serve
from tests.tools.backendclock import BackendClock

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "tell me a story"}]
CHAT: dict[str, Any] = {"model": "any-model", "messages": MESSAGES}
PROMPT_TOKENS = 4 + 4  # four words plus the mock's 4 per message


@pytest.fixture(scope="module")
def fast_url() -> Iterator[str]:
    with serve(create_app(ttft_ms=0, tokens_per_second=math.inf)) as url:
        yield url


@pytest.fixture
def paced_url() -> Iterator[str]:
    with serve(create_app(ttft_ms=200, tokens_per_second=100)) as url:
        yield url


@pytest.fixture
def sdk(fast_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=fast_url + "/v1", api_key="x", max_retries=0) as client:
        yield client


def sse_events(raw: bytes) -> list[Any]:
    """Each `data:` event of an SSE body, parsed; the terminator stays the string "[DONE]"."""
    assert raw.endswith(b"\n\n")
    events: list[Any] = []
    for block in raw[:-2].split(b"\n\n"):
        assert block.startswith(b"data: ")
        data = block[len(b"data: ") :]
        events.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return events


def post_stream(url: str, path: str, body: dict[str, Any]) -> tuple[httpx.Response, bytes]:
    with httpx.stream("POST", url + path, json=body, timeout=10) as response:
        return response, response.read()


def stats(url: str) -> dict[str, Any]:
    result: dict[str, Any] = httpx.get(url + "/mock/stats").json()
    return result


def wait_for_stats(url: str, check: Callable[[dict[str, Any]], bool], timeout_s: float) -> float:
    """Poll /mock/stats until `check` passes; returns the seconds it took."""
    start = time.monotonic()
    with httpx.Client(base_url=url) as client:
        while True:
            seen = client.get("/mock/stats").json()
            elapsed = time.monotonic() - start
            if check(seen):
                return elapsed
            assert elapsed < timeout_s, f"stats never matched: {seen}"
            time.sleep(0.002)


def test_chat_answers_with_max_tokens_words_and_usage(sdk: openai.OpenAI) -> None:
    answer = sdk.chat.completions.create(model="any-model", messages=MESSAGES, max_tokens=5)
    assert answer.model == "any-model"
    assert answer.object == "chat.completion"
    choice = answer.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert len((choice.message.content or "").split()) == 5
    assert answer.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (PROMPT_TOKENS, 5)
    assert answer.usage.total_tokens == PROMPT_TOKENS + 5


def test_completions_answer_with_text_and_usage(sdk: openai.OpenAI) -> None:
    answer = sdk.completions.create(model="legacy", prompt="one two three four", max_tokens=3)
    assert answer.model == "legacy"
    assert answer.choices[0].finish_reason == "length"
    assert len(answer.choices[0].text.split()) == 3
    assert answer.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (4, 3)


def test_n_and_a_prompt_batch_give_an_answer_each_as_vllm_does(sdk: openai.OpenAI) -> None:
    chat = sdk.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5, n=3)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert chat.usage is not None
    assert chat.usage.completion_tokens == 3 * 5
    batch = sdk.completions.create(model="m", prompt=["one two", "three"], max_tokens=4, n=2)
    assert len(batch.choices) == 2 * 2
    assert batch.usage is not None
    assert (batch.usage.prompt_tokens, batch.usage.completion_tokens) == (3, 4 * 4)


def test_answers_are_deterministic_per_prompt(sdk: openai.OpenAI) -> None:
    def ask(content: str) -> str | None:
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": content}]
        answer = sdk.chat.completions.create(model="m", messages=messages, max_tokens=12)
        return answer.choices[0].message.content

    assert ask("alpha") == ask("alpha")
    assert ask("alpha") != ask("beta")


def test_answer_length_defaults_to_256_and_stops_naturally(sdk: openai.OpenAI) -> None:
    answer = sdk.chat.completions.create(model="m", messages=MESSAGES)
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 256
    short = sdk.chat.completions.create(
        model="m", messages=MESSAGES, extra_body={"mock_completion_tokens": 7}
    )
    assert short.choices[0].finish_reason == "stop"
    assert len((short.choices[0].message.content or "").split()) == 7


def test_max_completion_tokens_is_honoured(sdk: openai.OpenAI) -> None:
    answer = sdk.chat.completions.create(model="m", messages=MESSAGES, max_completion_tokens=4)
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 4
    assert answer.choices[0].finish_reason == "length"


def test_chat_stream_sends_role_then_one_token_per_event(fast_url: str) -> None:
    response, raw = post_stream(
        fast_url, "/v1/chat/completions", CHAT | {"stream": True, "max_tokens": 6}
    )
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == 1 + 6
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tokens = [chunk["choices"][0]["delta"]["content"] for chunk in chunks[1:]]
    assert all(len(token.split()) == 1 for token in tokens)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 6 + ["length"]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "any-model" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert all("usage" not in chunk for chunk in chunks)
    assert b'"object":"chat.completion.chunk"' in raw  # compact JSON, like OpenAI and vLLM


def test_chat_stream_with_include_usage_ends_with_usage_chunk(fast_url: str) -> None:
    body = CHAT | {"stream": True, "max_tokens": 3, "stream_options": {"include_usage": True}}
    _, raw = post_stream(fast_url, "/v1/chat/completions", body)
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = events[:-1]
    assert len(chunks) == 1 + 3
    assert all(chunk["usage"] is None for chunk in chunks)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": 3,
        "total_tokens": PROMPT_TOKENS + 3,
    }


def test_completions_stream_carries_text(fast_url: str) -> None:
    body = {"model": "m", "prompt": "hi", "stream": True, "max_tokens": 4}
    _, raw = post_stream(
        fast_url, "/v1/completions", body | {"stream_options": {"include_usage": True}}
    )
    events = sse_events(raw)
    *chunks, usage_chunk, done = events
    assert done == "[DONE]"
    assert [c["object"] for c in chunks] == ["text_completion"] * 4
    assert all(len(c["choices"][0]["text"].split()) == 1 for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["usage"]["completion_tokens"] == 4
    _, raw_without = post_stream(fast_url, "/v1/completions", body)
    assert [e["choices"][0]["text"] for e in sse_events(raw_without)[:-1]] == [
        c["choices"][0]["text"] for c in chunks
    ]


def test_sdk_stream_matches_the_non_stream_answer(sdk: openai.OpenAI) -> None:
    whole = sdk.chat.completions.create(model="m", messages=MESSAGES, max_tokens=9)
    stream = sdk.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=9,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 9


def test_a_stop_sequence_ends_the_answer_where_it_begins_as_vllm_does(
    sdk: openai.OpenAI,
) -> None:
    # The mock ignored `stop`: the sequence came back in the text, and the answer ran on.
    full = sdk.chat.completions.create(model="m", messages=MESSAGES, max_tokens=12)
    words = (full.choices[0].message.content or "").split(" ")
    stop = " " + words[5][:2]  # begins in token 5 and ends in it: 6 tokens generated
    whole = sdk.chat.completions.create(model="m", messages=MESSAGES, max_tokens=12, stop=stop)
    assert whole.choices[0].message.content == " ".join(words[:5])
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage is not None
    assert whole.usage.completion_tokens == 6
    stream = sdk.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=12,
        stop=["no such words", words[3][1:]],  # mid-token: the kept text ends inside token 3
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == " ".join(words[:3]) + " " + words[3][:1]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4
    text_answer = sdk.completions.create(model="m", prompt="a b", max_tokens=5, stop=["zzz"])
    assert text_answer.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(model="m", messages=MESSAGES, stop=[""])
    assert caught.value.param == "stop"


def test_n_past_openais_range_is_a_400(
    sdk: openai.OpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(model="m", messages=MESSAGES, n=129)
    assert caught.value.status_code == 400
    assert caught.value.param == "n"
    assert caught.value.type == "invalid_request_error"


def test_stream_options_without_a_stream_is_a_400_as_openai_and_vllm_answer(
    sdk: openai.OpenAI,
) -> None:
    # The mock answered 200, so a gateway that sent the option on a whole answer passed its
    # tests against the mock and failed against vLLM.
    options: dict[str, Any] = {"stream_options": {"include_usage": True}, "max_tokens": 2}
    with pytest.raises(openai.BadRequestError) as chat:
        sdk.chat.completions.create(model="m", messages=MESSAGES, **options)
    with pytest.raises(openai.BadRequestError) as text:
        sdk.completions.create(model="m", prompt="a b", **options)
    for caught in (chat, text):
        assert caught.value.param == "stream_options"
        assert "only allowed when 'stream' is enabled" in caught.value.message


def test_embeddings_via_sdk_base64_default_match_float(sdk: openai.OpenAI) -> None:
    default = sdk.embeddings.create(model="mock-embed", input=["a cat", "a dog"])
    floats = sdk.embeddings.create(
        model="mock-embed", input=["a cat", "a dog"], encoding_format="float"
    )
    assert [d.embedding for d in default.data] == [d.embedding for d in floats.data]
    first, second = (d.embedding for d in floats.data)
    assert len(first) == 384
    assert math.isclose(math.fsum(v * v for v in first), 1.0, rel_tol=1e-5)
    assert first != second
    assert default.usage.prompt_tokens == 4
    again = sdk.embeddings.create(model="mock-embed", input="a cat", dimensions=16)
    assert len(again.data[0].embedding) == 16
    assert math.isclose(math.fsum(v * v for v in again.data[0].embedding), 1.0, rel_tol=1e-5)


def test_embeddings_base64_is_little_endian_float32(fast_url: str) -> None:
    body = {"model": "e", "input": [[1, 2, 3]], "encoding_format": "base64", "dimensions": 8}
    answer = httpx.post(fast_url + "/v1/embeddings", json=body).json()
    packed = base64.b64decode(answer["data"][0]["embedding"])
    vector = struct.unpack("<8f", packed)
    assert math.isclose(math.fsum(v * v for v in vector), 1.0, rel_tol=1e-5)
    assert answer["usage"] == {"prompt_tokens": 3, "total_tokens": 3}


def test_models_lists_the_configured_models(sdk: openai.OpenAI) -> None:
    assert [model.id for model in sdk.models.list()] == ["mock-llm", "mock-embed"]


def test_model_listings_are_counted_apart_from_requests(paced_url: str) -> None:
    """A gateway's health probes list the models on their own clock; they must not move the
    request count that tests and benchmarks read."""
    with httpx.Client(base_url=paced_url) as http:
        for _ in range(3):
            http.get("/v1/models").raise_for_status()
        http.post("/v1/chat/completions", json=CHAT | {"max_tokens": 1}).raise_for_status()
        stats = http.get("/mock/stats").json()
    assert (stats["requests_total"], stats["models_listed"]) == (1, 3)


def test_errors_are_openai_shaped(fast_url: str) -> None:
    malformed = httpx.post(fast_url + "/v1/chat/completions", content=b"{not json")
    assert malformed.status_code == 400
    assert set(malformed.json()["error"]) == {"message", "type", "param", "code"}
    assert malformed.json()["error"]["type"] == "invalid_request_error"
    unknown = httpx.get(fast_url + "/v1/nothing-here")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(fast_url + "/v1/chat/completions").status_code == 405


def test_an_answer_longer_than_a_models_context_is_a_400(sdk: openai.OpenAI) -> None:
    # The mock built any length asked in one go: 5M tokens held its loop, and every other
    # stream's pacing, 10 s and took 400 MB; a billion would end it.
    longest = sdk.chat.completions.create(
        model="m", messages=MESSAGES, extra_body={"mock_completion_tokens": 131_072}
    )
    assert longest.usage is not None
    assert longest.usage.completion_tokens == 131_072
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(
            model="m", messages=MESSAGES, extra_body={"mock_completion_tokens": 131_073}
        )
    assert caught.value.param == "mock_completion_tokens"
    # Nor may n choices for each prompt of a batch add up past 128 answers of that length:
    # n=128 and 2,048 prompts of a few bytes each once asked for 34 billion tokens.
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.completions.create(
            model="m", prompt=["a", "b"], n=128, extra_body={"mock_completion_tokens": 65_537}
        )
    assert caught.value.param == "n"
    assert "256 choices of 65537 tokens" in caught.value.message


def test_mock_fail_answers_with_the_requested_status(sdk: openai.OpenAI, fast_url: str) -> None:
    with pytest.raises(openai.InternalServerError) as caught:
        sdk.chat.completions.create(model="m", messages=MESSAGES, extra_body={"mock_fail": 503})
    assert caught.value.status_code == 503
    limited = httpx.post(
        fast_url + "/v1/embeddings",
        json={"model": "e", "input": "x", "mock_fail": 429, "mock_retry_after_s": 3},
    )
    assert limited.status_code == 429
    assert limited.headers["retry-after"] == "3"
    assert limited.json()["error"]["type"] == "rate_limit_error"


def test_a_backend_that_always_fails_fails_every_request() -> None:
    # create_app(fail_status=...) once failed chat and completions only: embeddings and
    # rerank answered 200 from a backend meant to be down.
    with serve(create_app(fail_status=503)) as url:
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as sdk:
            with pytest.raises(openai.InternalServerError):
                sdk.chat.completions.create(model="m", messages=MESSAGES)
            with pytest.raises(openai.InternalServerError) as caught:
                sdk.embeddings.create(model="mock-embed", input="a cat")
        rerank = httpx.post(url + "/v1/rerank", json={"query": "a", "documents": ["a"]})
    assert caught.value.status_code == rerank.status_code == 503
    assert rerank.json()["error"]["code"] == "mock_fail"


def test_mock_fail_after_tokens_drops_the_connection_mid_stream() -> None:
    with serve(create_app(tokens_per_second=math.inf)) as url:
        body = CHAT | {"stream": True, "mock_fail_after_tokens": 3}
        received: list[bytes] = []
        with httpx.stream("POST", url + "/v1/chat/completions", json=body) as response:
            with pytest.raises(httpx.RemoteProtocolError):
                _read_into(response, received)
        assert b"".join(received).count(b'"content":"') == 1 + 3
        assert b"[DONE]" not in b"".join(received)
        assert stats(url)["streams_aborted"] == 1


def _read_into(response: httpx.Response, chunks: list[bytes]) -> None:
    for chunk in response.iter_bytes():
        chunks.append(chunk)


def test_mock_delay_holds_back_the_headers(fast_url: str) -> None:
    start = time.monotonic()
    with httpx.stream(
        "POST",
        fast_url + "/v1/chat/completions",
        json=CHAT | {"stream": True, "mock_delay_ms": 300},
    ) as response:
        assert time.monotonic() - start >= 0.3
        response.read()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            fast_url + "/v1/embeddings",
            json={"model": "e", "input": "x", "mock_delay_ms": 2000},
            timeout=httpx.Timeout(5, read=0.1),
        )


def test_stats_count_streams_and_record_the_last_request() -> None:
    with serve(create_app(tokens_per_second=math.inf)) as url:
        post_stream(url, "/v1/chat/completions", CHAT | {"stream": True, "max_tokens": 5})
        httpx.post(
            url + "/v1/completions",
            json={"model": "m", "prompt": "p", "max_tokens": 2},
            headers={"authorization": "Bearer sk-test"},
        )
        seen = stats(url)
        assert seen["streams_started"] == seen["streams_completed"] == 1
        assert (seen["requests_total"], seen["tokens_sent"], seen["inflight"]) == (2, 7, 0)
        assert seen["last_request"] == {"model": "m", "prompt": "p", "max_tokens": 2}
        assert seen["last_authorization"] == "Bearer sk-test"
        reset = httpx.post(url + "/mock/stats/reset").json()
        assert reset["requests_total"] == reset["tokens_sent"] == 0
        assert reset["last_request"] is None


def test_client_abort_mid_stream_counts_as_cancelled_and_stops_the_stream(paced_url: str) -> None:
    """The stream stops soon after the client leaves, counted in tokens the backend's own
    counters saw sent, not in milliseconds: at 100 tokens/s, under 100 tokens is within a
    second, ten times what an idle machine needs, and far from the 1,000 asked for."""
    body = CHAT | {"stream": True, "max_tokens": 1000}
    with httpx.stream("POST", paced_url + "/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if '"content":" ' in line:
                break
    # Leaving the block closed the half-read response, and with it the connection.
    wait_for_stats(paced_url, lambda s: s["streams_cancelled"] == 1, timeout_s=5)
    seen = stats(paced_url)
    assert (seen["streams_completed"], seen["inflight"]) == (0, 0)
    assert 0 < seen["tokens_sent"] < 100


def test_client_leaving_a_non_stream_request_cancels_it(paced_url: str) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            paced_url + "/v1/chat/completions",
            json=CHAT | {"max_tokens": 100},
            timeout=httpx.Timeout(5, read=0.05),
        )
    # Without the cancel the answer completes after 1.2 s and is never counted as cancelled.
    wait_for_stats(paced_url, lambda s: s["requests_cancelled"] == 1, timeout_s=5)
    assert stats(paced_url)["inflight"] == 0


def test_first_token_after_ttft_then_paced() -> None:
    """Timed by the backend's own clock (a loaded client took 3.3 s to read the first token):
    never early (but for the event loop's 1 ms timer granularity: uvloop's timers may fire a
    fraction of a millisecond before their time; 0.38985 s was seen for 0.39 s), and within ten
    times the schedule, which a wrong unit or rate exceeds."""
    backend = BackendClock(create_app(ttft_ms=200, tokens_per_second=100))
    with serve(backend) as url:
        body = CHAT | {"stream": True, "max_tokens": 20}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body) as response:
            assert sum('"content":"' in line for line in response.iter_lines()) == 1 + 20
        httpx.post(url + "/v1/chat/completions", json=CHAT | {"max_tokens": 20})
    stream, answer = backend.timelines
    early_s = 0.001
    assert 0.2 - early_s <= stream.ttft_s < 2.0
    assert 0.39 - early_s <= stream.e2e_s < 3.9  # ttft 0.2 s + 19 tokens at 100/s
    assert 0.39 - early_s <= answer.e2e_s < 3.9


def test_create_app_rejects_impossible_settings() -> None:
    with pytest.raises(ValueError, match="tokens_per_second"):
        create_app(tokens_per_second=0)
    with pytest.raises(ValueError, match="ttft_ms"):
        create_app(ttft_ms=-1)


def test_late_stream_coalesces_due_tokens_and_never_sends_early() -> None:
    asyncio.run(_coalescing_scenario())


async def _coalescing_scenario() -> None:
    clock = FakeClock()
    writes: list[tuple[bytes, bool]] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        writes.append((message["body"], message["more_body"]))

    base = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m"}
    stream = StreamRun(
        send=send,
        fmt=SseFormat.completion(base, "length", None),
        tokens=TokenSource("p"),
        schedule=Schedule(first_due_s=1.0, interval_s=0.1, n_tokens=5),
        ticker=Ticker(clock),
        clock=clock,
    )
    task = asyncio.create_task(stream.run())
    await asyncio.sleep(0.02)  # several ticks pass, but the fake clock has not reached 1.0
    assert writes == []
    clock.advance(1.25)  # tokens 0, 1 and 2 are now due, 3 and 4 are not
    await _until(lambda: bool(writes))
    assert [(body.count(b"data: "), more) for body, more in writes] == [(3, True)]
    clock.advance(10.0)
    assert await asyncio.wait_for(task, timeout=10) is Outcome.COMPLETED
    body, more = writes[1]
    assert (body.count(b"data: "), more) == (2 + 1, False)  # two tokens and [DONE], one write
    assert body.endswith(b"data: [DONE]\n\n")


async def _until(condition: Callable[[], bool]) -> None:
    """Let the ticker run (it polls the fake clock every millisecond) until `condition` holds."""
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition never held")
