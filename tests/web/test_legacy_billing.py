"""What /v1/embeddings and /v1/completions requests bill, end to end: a small backend answering
as a test sets, a real gateway with a SQLite ledger (tests/web/test_billing.py's policy), and
the `openai` SDK as the client.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from proxy.app import create_app
from proxy.tokens.tiktoken_counter import encoding_from_file
from tests.conftest import ALPHA_KEY
from tests.servers import serve
from tests.shared import tokenizer_file
from tests.web.test_billing import billing_policy, ledger_path, ledger_records

__all__ = ["ledger_path"]  # a fixture

Answer = Callable[[dict[str, Any]], dict[str, Any] | Response]


def _backend(answer: Answer) -> Starlette:
    """Answers /v1/completions and /v1/embeddings with `answer(body)`."""

    async def answered(request: Request) -> Response:
        given = answer(await request.json())
        return given if isinstance(given, Response) else JSONResponse(given)

    routes = [
        Route(path, answered, methods=["POST"]) for path in ("/v1/completions", "/v1/embeddings")
    ]
    return Starlette(routes=routes)


@pytest.fixture
def client_of(ledger_path: Path) -> Iterator[Callable[[Answer], openai.OpenAI]]:
    """A real gateway in front of a backend answering as a test says, and an SDK client."""
    with ExitStack() as servers:

        def make(answer: Answer) -> openai.OpenAI:
            backend = servers.enter_context(serve(_backend(answer)))
            gateway = servers.enter_context(serve(create_app(billing_policy(backend, ledger_path))))
            return openai.OpenAI(base_url=gateway + "/v1", api_key=ALPHA_KEY, max_retries=0)

        yield make


def _embeddings(usage: dict[str, int]) -> Answer:
    def answer(body: dict[str, Any]) -> dict[str, Any]:
        data = [{"object": "embedding", "index": i, "embedding": [0.5, 0.25]} for i in range(2)]
        return {"object": "list", "model": "exact-llm", "data": data, "usage": usage}

    return answer


def test_an_embedding_bills_no_output_a_backend_reports(
    client_of: Callable[[Answer], openai.OpenAI], ledger_path: Path
) -> None:
    """An embedding generates nothing, but a backend's `completion_tokens: 5000` on one was
    believed: the request was billed 5,000 output tokens (0.01 USD at 2 USD a million)."""
    usage = {"prompt_tokens": 7, "completion_tokens": 5000, "total_tokens": 5007}
    client = client_of(_embeddings(usage))
    result = client.embeddings.create(model="exact-llm", input=["first", "second"])
    assert [item.embedding for item in result.data] == [[0.5, 0.25]] * 2
    [record] = ledger_records(ledger_path, 1)
    assert (record.operation, record.output_tokens) == ("embeddings", 0)
    assert record.usage_source == "counted"  # the backend's usage is not believed
    assert record.input_tokens == 2  # "first" and "second", one token each


def test_an_honest_embeddings_usage_is_billed(
    client_of: Callable[[Answer], openai.OpenAI], ledger_path: Path
) -> None:
    client = client_of(_embeddings({"prompt_tokens": 7, "completion_tokens": 0, "total_tokens": 7}))
    client.embeddings.create(model="exact-llm", input=["first", "second"])
    [record] = ledger_records(ledger_path, 1)
    assert (record.input_tokens, record.output_tokens, record.usage_source) == (7, 0, "backend")


def _completions(seen: list[dict[str, Any]]) -> Answer:
    """One choice of one token for each prompt; each body kept in `seen`."""

    def answer(body: dict[str, Any]) -> dict[str, Any]:
        seen.append(body)
        prompt = body["prompt"]
        count = len(prompt) if isinstance(prompt, list) and type(prompt[0]) is not int else 1
        choices = [{"index": i, "text": " x", "finish_reason": "length"} for i in range(count)]
        usage = {"prompt_tokens": count, "completion_tokens": count}
        return {"id": "c", "object": "text_completion", "choices": choices, "usage": usage}

    return answer


def test_a_completion_without_max_tokens_is_held_to_the_apis_16_not_4096(
    client_of: Callable[[Answer], openai.OpenAI], ledger_path: Path
) -> None:
    """A completion without `max_tokens` generates 16 tokens at OpenAI and in vLLM. Under a
    quota the gateway sent it with `max_tokens: 4096` (chat's default bound), so the backend
    wrote answers 256 times as long, and a batch of 300 prompts, which reserved 300 x 4096
    tokens, was refused as one that "can never be admitted" under a 1,000,000-token quota."""
    seen: list[dict[str, Any]] = []
    client = client_of(_completions(seen))
    client.completions.create(model="exact-llm", prompt="Once upon a time")
    assert seen[-1]["max_tokens"] == 16
    batch = client.completions.create(model="exact-llm", prompt=["Once upon a time"] * 300)
    assert len(batch.choices) == 300
    assert seen[-1]["max_tokens"] == 16
    client.completions.create(model="exact-llm", prompt="Once upon a time", max_tokens=100)
    assert seen[-1]["max_tokens"] == 100  # the client's own bound, as it was
    assert len(ledger_records(ledger_path, 3)) == 3


def _batch(seen: list[dict[str, Any]], reported_tokens: int) -> Answer:
    """Twelve " hello" tokens for each prompt of a batch, the usage reporting only
    `reported_tokens` of them."""

    def answer(body: dict[str, Any]) -> dict[str, Any] | Response:
        seen.append(body)
        if body.get("stream"):
            stream = _batch_stream(len(body["prompt"]), body.get("user") == "together")
            return StreamingResponse(stream, media_type="text/event-stream")
        text = " hello" * 12
        choices = [
            {"index": i, "text": text, "finish_reason": "stop"} for i in range(len(body["prompt"]))
        ]
        usage = {"prompt_tokens": 6, "completion_tokens": reported_tokens}
        return {"id": "c", "object": "text_completion", "choices": choices, "usage": usage}

    return answer


def test_a_batch_bills_every_prompts_answer_not_the_one_reported(
    client_of: Callable[[Answer], openai.OpenAI], ledger_path: Path
) -> None:
    """The gateway overrules a backend that reports one choice's tokens of `n`, but a batch's
    prompts were not choices to it: three prompts answered with 12 tokens each, reported as 12,
    were billed 12 (with `n: 3` they were billed 36)."""
    client = client_of(_batch([], 12))
    answer = client.completions.create(model="exact-llm", prompt=["a", "b", "c"], max_tokens=20)
    assert len(answer.choices) == 3
    [record] = ledger_records(ledger_path, 1)
    assert (record.output_tokens, record.usage_source) == (36, "counted_output")


async def _batch_stream(prompts: int, together: bool = False) -> AsyncIterator[bytes]:
    """Twelve " hello" events for each prompt, interleaved, a finish event each, no usage; or,
    `together`, each event carrying every prompt's choice."""

    def event(indexes: range, text: str, finish: str | None = None) -> bytes:
        choices = [{"index": i, "text": text, "finish_reason": finish} for i in indexes]
        chunk = {"id": "c", "object": "text_completion", "choices": choices}
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    each = [range(prompts)] if together else [range(i, i + 1) for i in range(prompts)]
    for _ in range(12):
        yield b"".join(event(indexes, " hello") for indexes in each)
    yield b"".join(event(indexes, "", "stop") for indexes in each)
    yield b"data: [DONE]\n\n"


@pytest.mark.parametrize("together", [False, True])
def test_a_streamed_batch_without_usage_bills_what_was_relayed(
    client_of: Callable[[Answer], openai.OpenAI], ledger_path: Path, together: bool
) -> None:
    """A stream's own count is its token events less each choice's finish event; a batch's
    prompts were not counted as choices, so three prompts' 36 tokens were billed 38; and sent
    in events that each carry all three choices, billed 10."""
    client = client_of(_batch([], 0))
    user = "together" if together else "apart"  # tells the backend how to send them
    stream = client.completions.create(
        model="exact-llm", prompt=["a", "b", "c"], max_tokens=20, stream=True, user=user
    )
    assert "".join(choice.text for chunk in stream for choice in chunk.choices) == " hello" * 36
    [record] = ledger_records(ledger_path, 1)
    assert (record.output_tokens, record.usage_source) == (36, "counted")


def _echoing(body: dict[str, Any]) -> dict[str, Any]:
    """Each prompt echoed, then " done": the first prompt's answer repeats the second prompt's
    words first (as "repeat after me" asks); no usage."""
    first, second = body["prompt"]
    texts = [first + second.removeprefix(first) + " done", second + " done"]
    choices = [{"index": i, "text": text, "finish_reason": "stop"} for i, text in enumerate(texts)]
    return {"id": "c", "object": "text_completion", "choices": choices}


def test_an_echoed_batch_takes_off_each_choices_own_prompt(
    client_of: Callable[[Answer], openai.OpenAI], ledger_path: Path
) -> None:
    """Under `echo: true` a choice's text was cut after the longest prompt it began with, not
    its own: an answer that began with a longer prompt's words lost them all, and 300 tokens
    generated were billed as none, where the backend reported no usage."""
    client = client_of(_echoing)
    prompts = ["Repeat after me:", "Repeat after me:" + " yes" * 300]
    answer = client.completions.create(model="exact-llm", prompt=prompts, echo=True, max_tokens=400)
    assert answer.choices[0].text.endswith(" yes done")
    [record] = ledger_records(ledger_path, 1)
    assert record.usage_source == "counted"
    assert record.output_tokens >= 302  # 300 " yes" and two " done"


def test_an_echoed_prompt_of_token_ids_is_no_output(
    client_of: Callable[[Answer], openai.OpenAI], ledger_path: Path
) -> None:
    """A prompt sent as token ids comes back under `echo: true` as its text: the gateway could
    not take it off, counted it as output, overruled the honest usage of `n: 2` and billed the
    400-token prompt again for each choice."""
    encoding, _ = encoding_from_file(tokenizer_file("qwen2.5/qwen.tiktoken"), "qwen2.5")
    text = "Repeat after me: " + "the quick brown fox jumps over the lazy dog. " * 40
    ids = encoding.encode(text)

    def echoing(body: dict[str, Any]) -> dict[str, Any]:
        answer = encoding.decode(body["prompt"]) + " hello" * 12
        choices = [{"index": i, "text": answer, "finish_reason": "stop"} for i in range(2)]
        usage = {"prompt_tokens": len(ids), "completion_tokens": 24}
        return {"id": "c", "object": "text_completion", "choices": choices, "usage": usage}

    client = client_of(echoing)
    answer = client.completions.create(model="exact-llm", prompt=ids, n=2, echo=True, max_tokens=20)
    assert answer.choices[1].text.startswith(text)
    [record] = ledger_records(ledger_path, 1)
    assert (record.usage_source, record.output_tokens) == ("backend", 24)
