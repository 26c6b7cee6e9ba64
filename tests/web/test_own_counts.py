"""What the gateway's own output count may overrule or stand for, end to end: an estimate beside
an honest backend, a stream padded with empty events, a completion that echoes its prompt.

The lying and scripted backends answer honestly with the usage a test sets; a real gateway with
a SQLite ledger (tests/web/test_billing.py's fixtures) bills them.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from proxy.app import create_app
from proxy.ledger import UsageRecord
from tests.servers import serve
from tests.telemetry.scripted import (
    AtLeast,
    Received,
    Script,
    chunk,
    event,
    scripted_backend,
    usage_chunk,
)
from tests.web.lyingbackend import LyingBackend
from tests.web.test_billing import (
    AUTH,
    billing_policy,
    chat,
    exact_output,
    gateway,
    ledger_path,
    ledger_records,
    liar,
)

__all__ = ["gateway", "ledger_path", "liar"]  # fixtures


def test_two_choices_on_a_model_without_a_tokenizer_bill_an_honest_backends_usage(
    liar: tuple[LyingBackend, str], gateway: str, ledger_path: Path
) -> None:
    """The estimate reads " hello" as 1.5 tokens (6 characters at 4 a token), as it reads
    much English prose at 1.1-1.3: an honest backend reporting both choices was overruled by
    the estimate (36 billed for 24); one reporting only the first choice still is."""
    backend, _ = liar
    both = exact_output(2)
    backend.usage = b'{"prompt_tokens": 9, "completion_tokens": %d}' % both
    assert chat(gateway, model="guess-llm", n=2).status_code == 200
    backend.usage = b'{"prompt_tokens": 9, "completion_tokens": %d}' % exact_output()
    assert chat(gateway, model="guess-llm", n=2).status_code == 200
    honest, one_choice = ledger_records(ledger_path, 2)
    assert (honest.usage_source, honest.output_tokens) == ("backend", both)
    assert one_choice.usage_source == "counted_output"
    assert one_choice.output_tokens >= both


@pytest.mark.parametrize("usage", [True, False])
def test_textless_events_never_bill_past_the_bound_the_backend_was_sent(
    ledger_path: Path, usage: bool
) -> None:
    """A backend padding a stream with 500 empty deltas, after 3 words, for `max_tokens: 10`:
    each event after the first text is a token to the gateway's count (it does not search every
    event for text), which overruled the backend's usage (or stood for it) and billed 502."""
    padded: list[bytes | float] = [chunk({"role": "assistant", "content": ""})]
    padded += [chunk({"content": " word"}) for _ in range(3)] + [chunk({})] * 500
    padded += [chunk({}, "stop")] + ([usage_chunk(9, 3)] if usage else []) + [b"data: [DONE]\n\n"]
    text, record = _streamed_bill(ledger_path, padded, max_tokens=10)
    assert text.count(" word") == 3
    # Events are not read for text, so empty ones sharing reads with text may count: never past
    # the bound (3, the words alone, where the reads fall so that the end's count finds them).
    assert 3 <= record.output_tokens <= 10


def _streamed_bill(
    ledger_path: Path,
    script: Script,
    *,
    max_tokens: int,
    n: int = 1,
    received: Received | None = None,
    leave_at: str | None = None,
) -> tuple[str, UsageRecord]:
    """What a client streaming `script` from the scripted backend reads, and its record;
    `received` counts each event the client reads, for a script in lock-step with it. The
    client leaves once it reads a line holding `leave_at`."""
    with serve(scripted_backend({"script": script})) as backend:
        with serve(create_app(billing_policy(backend, ledger_path))) as gateway:
            messages = [{"role": "user", "content": "script"}]
            body = {"model": "exact-llm", "messages": messages, "stream": True, "n": n}
            with httpx.stream(
                "POST", gateway + "/v1/chat/completions", json=body | {"max_tokens": max_tokens},
                headers=AUTH, timeout=30,
            ) as answer:  # fmt: skip
                lines = []
                for line in answer.iter_lines():
                    lines.append(line)
                    if received is not None and line.startswith("data:"):
                        received.add()
                    if leave_at is not None and leave_at in line:
                        break
                text = "\n".join(lines)
            record = _final_record(ledger_path)
    return text, record


def _final_record(ledger_path: Path) -> UsageRecord:
    """The one request's final record: a stream open past a second has a checkpoint first,
    which a loaded writer may replace after the client has read the stream's end."""
    deadline = time.monotonic() + 10
    while True:
        [record] = ledger_records(ledger_path, 1)
        if not record.checkpoint or time.monotonic() > deadline:
            return record
        time.sleep(0.05)


def _echoing_backend(words: int) -> Starlette:
    """Answers as `echo: true` asks: a completion's text is the prompt, then the words; a chat's
    content, as vLLM's, the last message's when it is the assistant's (a prefill), then the
    words. Its usage counts the words alone as output, as OpenAI's and vLLM's do."""

    async def answer(request: Request) -> JSONResponse:
        body = await request.json()
        n, words_text = body.get("n", 1), " hello" * words
        if "prompt" in body:
            item: dict[str, object] = {"text": body["prompt"] + words_text}
        else:
            last = body["messages"][-1]
            echoed = last["content"] if body.get("echo") and last["role"] == "assistant" else ""
            item = {"message": {"role": "assistant", "content": echoed + words_text}}
        choices = [{"index": i, **item, "finish_reason": "stop"} for i in range(n)]
        usage = {"prompt_tokens": 9, "completion_tokens": n * words}
        return JSONResponse({"id": "c", "choices": choices, "usage": usage})

    paths = ("/v1/completions", "/v1/chat/completions")
    return Starlette(routes=[Route(path, answer, methods=["POST"]) for path in paths])


def test_an_echoed_prompt_is_no_output(ledger_path: Path) -> None:
    """With `echo: true` each choice's text begins with the prompt. The gateway counts a whole
    answer's text when it has `n` > 1 choices: it counted the echoed prompt as output, overruled
    the honest usage, and billed the prompt again once per choice."""
    prompt = "Repeat after me: " + "the quick brown fox jumps over the lazy dog. " * 40
    with serve(_echoing_backend(12)) as backend:
        with serve(create_app(billing_policy(backend, ledger_path))) as gateway:
            body = {"model": "exact-llm", "prompt": prompt, "n": 2, "echo": True, "max_tokens": 20}
            answer = httpx.post(gateway + "/v1/completions", json=body, headers=AUTH, timeout=10)
            assert answer.status_code == 200
            assert answer.json()["choices"][0]["text"].startswith(prompt)
            [record] = ledger_records(ledger_path, 1)
    assert (record.usage_source, record.output_tokens) == ("backend", 24)


@pytest.mark.parametrize("usage", [True, False])
def test_events_without_text_between_tokens_are_not_billed(ledger_path: Path, usage: bool) -> None:
    """Three words, each followed by an event without text (a content filter's verdict) in a
    read of its own: each such event counted as a token, so the gateway's count (7) overruled
    the backend's honest 3, or stood for it (6) without usage. Each event is sent once the
    client has read the one before it, so each reaches the gateway in a read of its own."""
    received = Received()
    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": " word"}), chunk({})] * 3 + [chunk({}, "stop")]
    script: list[bytes | float | AtLeast] = [events[0]]
    for read, sent in enumerate(events[1:], start=1):
        script += [received.at(read), sent]  # once the client has read the events before it
    script += ([usage_chunk(9, 3)] if usage else []) + [b"data: [DONE]\n\n"]
    text, record = _streamed_bill(ledger_path, script, max_tokens=50, received=received)
    assert text.count(" word") == 3
    assert (record.usage_source, record.output_tokens) == ("backend" if usage else "counted", 3)


def _both(delta: dict[str, str], finish: str | None = None) -> bytes:
    """One event carrying both choices of `n: 2`, as some backends batch them."""
    item = {"delta": delta, "finish_reason": finish}
    choices = [{"index": i, **item} for i in range(2)]
    return event({"id": "c", "object": "chat.completion.chunk", "choices": choices})


def test_an_event_carrying_several_choices_bills_each_choices_token(ledger_path: Path) -> None:
    """A backend without usage that sends `n: 2`'s choices side by side in one event: the
    gateway counted each event as one token, so 2 x 5 words were billed 4."""
    script: list[bytes | float] = [_both({"role": "assistant", "content": ""})]
    script += [_both({"content": " word"}) for _ in range(5)]
    script += [_both({}, "stop"), b"data: [DONE]\n\n"]
    text, record = _streamed_bill(ledger_path, script, max_tokens=50, n=2)
    assert text.count(" word") == 10
    assert (record.usage_source, record.output_tokens) == ("counted", 10)


def test_a_finish_sharing_the_last_read_beside_a_textless_event_is_no_token(
    ledger_path: Path,
) -> None:
    """No usage; three words, an event without text in a read of its own after the second,
    and the finish event in the same read as the last word: the finish took a token's place
    in the count (4 billed for 3)."""
    script: list[bytes | float] = [chunk({"role": "assistant", "content": ""})]
    script += [chunk({"content": " word"}), 0.3, chunk({"content": " word"}), 0.3, chunk({})]
    script += [0.3, chunk({"content": " word"}) + chunk({}, "stop"), b"data: [DONE]\n\n"]
    text, record = _streamed_bill(ledger_path, script, max_tokens=50)
    assert text.count(" word") == 3
    assert (record.usage_source, record.output_tokens) == ("counted", 3)


def test_a_client_that_leaves_at_the_finish_is_not_billed_it_as_a_token(
    ledger_path: Path,
) -> None:
    """Three words, the last in the same read as the finish event; the client leaves there,
    before the usage and [DONE] come (a second later): the finish took a token's place in the
    bill of the words relayed (4 billed for 3), as it no longer does at a stream's end."""
    script: list[bytes | float] = [chunk({"role": "assistant", "content": ""})]
    script += [chunk({"content": " word"}), 0.3, chunk({"content": " word"}), 0.3]
    script += [chunk({"content": " word"}) + chunk({}, "stop"), 1.0, usage_chunk(9, 3)]
    script += [b"data: [DONE]\n\n"]
    text, record = _streamed_bill(ledger_path, script, max_tokens=50, leave_at='"stop"')
    assert text.count(" word") == 3
    assert record.client_disconnected
    assert (record.usage_source, record.output_tokens) == ("counted", 3)


def test_an_echoed_assistant_prefill_is_no_output(ledger_path: Path) -> None:
    """vLLM's chat `echo: true` puts the last message, an assistant's prefill, before each
    choice's content: the gateway counted it as output, overruled the honest usage of `n: 2`,
    and billed the prefill again once per choice."""
    prefill = "Sure. " + "the quick brown fox jumps over the lazy dog. " * 40
    messages = [{"role": "user", "content": "Go on."}, {"role": "assistant", "content": prefill}]
    with serve(_echoing_backend(12)) as backend:
        with serve(create_app(billing_policy(backend, ledger_path))) as gateway:
            body = {"model": "exact-llm", "messages": messages, "n": 2, "echo": True}
            answer = httpx.post(
                gateway + "/v1/chat/completions", json=body | {"max_tokens": 20}, headers=AUTH,
                timeout=10,
            )  # fmt: skip
            assert answer.status_code == 200
            assert answer.json()["choices"][1]["message"]["content"].startswith(prefill)
            [record] = ledger_records(ledger_path, 1)
    assert (record.usage_source, record.output_tokens) == ("backend", 24)


def test_a_legacy_function_call_is_output(ledger_path: Path) -> None:
    """A whole answer to the legacy `functions` carries its call in `function_call`, not
    `tool_calls`; counted without the backend's usage, it was no output: a call of 200 words of
    arguments was billed 0 output tokens."""
    arguments = '{"text": "' + "hello " * 200 + '"}'

    async def answer(request: Request) -> JSONResponse:
        call = {"name": "save", "arguments": arguments}
        message = {"role": "assistant", "content": None, "function_call": call}
        choice = {"index": 0, "message": message, "finish_reason": "function_call"}
        return JSONResponse({"id": "c", "object": "chat.completion", "choices": [choice]})

    backend_app = Starlette(routes=[Route("/v1/chat/completions", answer, methods=["POST"])])
    functions = [{"name": "save", "parameters": {"type": "object"}}]
    with serve(backend_app) as backend:
        with serve(create_app(billing_policy(backend, ledger_path))) as url:
            assert chat(url, functions=functions).status_code == 200
    [record] = ledger_records(ledger_path, 1)
    assert record.usage_source == "counted"
    assert record.output_tokens >= 200
