"""A backend's Responses or Messages usage is checked as chat's is: numbers it cannot believe are
not billed; the gateway's own exact counts (the model's tokenizer) are, and the record says so."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import orjson
import pytest
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from proxy.policy.units import hash_key
from proxy.tokens import load_counter
from tests.web.agentgateway import exact_gateway, qwen_spec
from tests.web.test_billing import ledger_records

KEY = "tw-usage-checks"
SINGLE_KEY = "tw-usage-checks-single"  # one request in flight at most
ANSWER = "hello " * 12
WORDS = ANSWER.split()
QUESTION = [{"role": "user", "content": "Say hello twelve times."}]


class UsageLiar:
    """Honest answers on /v1/responses and /v1/messages, streamed or whole; their `usage` is
    whatever is set (on a Messages stream, `start_usage` in message_start and `usage` in
    message_delta; on a Responses stream, `usage` in response.completed). A whole
    answer's fields may be set as raw JSON bytes too (`raw`: what orjson cannot write)."""

    def __init__(self) -> None:
        self.usage: dict[str, object] | None = {}
        self.start_usage: dict[str, object] = {}
        self.raw: dict[str, bytes] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = await Request(scope, receive).body()
        if body and orjson.loads(body).get("stream"):
            headers = [(b"content-type", b"text/event-stream")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            responses = scope["path"] == "/v1/responses"
            events = self._response_stream() if responses else self._message_stream()
            await send({"type": "http.response.body", "body": events})
            return
        if scope["path"] == "/v1/responses":
            answer = self._response()
        else:
            answer = {"type": "message", "role": "assistant", "stop_reason": "end_turn"}
            answer |= {"content": [{"type": "text", "text": ANSWER}], "usage": self.usage}
        body = orjson.dumps(answer)[:-1]
        for name, value in self.raw.items():  # the later key wins
            body += b',"' + name.encode() + b'":' + value
        body += b"}"
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _response(self) -> dict[str, object]:
        item = {"type": "message", "role": "assistant", "status": "completed"}
        item["content"] = [{"type": "output_text", "text": ANSWER, "annotations": []}]
        answer: dict[str, object] = {"id": "r1", "object": "response", "status": "completed"}
        return answer | {"output": [item], "usage": self.usage}

    def _response_stream(self) -> bytes:
        start = {"id": "r1", "object": "response", "status": "in_progress", "output": []}
        events: list[dict[str, object]] = [
            {"type": "response.created", "response": start},
            *(
                {"type": "response.output_text.delta", "delta": w + " ", "output_index": 0}
                for w in WORDS
            ),
            {"type": "response.completed", "response": self._response()},
        ]
        return b"".join(
            b"event: " + str(e["type"]).encode() + b"\ndata: " + orjson.dumps(e) + b"\n\n"
            for e in events
        )

    def _message_stream(self) -> bytes:
        message = {"id": "m1", "type": "message", "role": "assistant", "content": []}
        events: list[dict[str, object]] = [
            {"type": "message_start", "message": message | {"usage": self.start_usage}},
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
            *({"type": "content_block_delta", "index": 0, "delta": _text(w)} for w in WORDS),
            {"type": "content_block_stop", "index": 0},
            {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": self.usage},
            {"type": "message_stop"},
        ]
        if self.usage is None:  # a message_delta without usage
            del events[-2]["usage"]
        return b"".join(
            b"event: " + str(e["type"]).encode() + b"\ndata: " + orjson.dumps(e) + b"\n\n"
            for e in events
        )


def _text(word: str) -> dict[str, str]:
    return {"type": "text_delta", "text": word}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[UsageLiar, str, Path]]:
    liar = UsageLiar()
    ledger = Path(tmp_path_factory.mktemp("usage")) / "ledger.db"
    tenants = f"""  alpha: {{api_keys: [{hash_key(KEY)}], models: [exact-llm]}}
  single:
    api_keys: [{hash_key(SINGLE_KEY)}]
    models: [exact-llm]
    limits: {{max_concurrent: 1}}
"""
    with exact_gateway(liar, ledger, tenants) as url:
        yield liar, url, ledger


BAD = [
    {"input_tokens": -5, "output_tokens": 12},
    {"input_tokens": 9, "output_tokens": 10**12},
    {"input_tokens": 9.0, "output_tokens": 12},
    {"input_tokens": True, "output_tokens": True},
    {"input_tokens": 9},
    {"input_tokens": 9, "output_tokens": 12, "cache_read_input_tokens": -100},
]


def ask(url: str, route: str) -> httpx.Response:
    if route == "/v1/responses":
        body: dict[str, object] = {"model": "exact-llm", "input": QUESTION}
    else:
        body = {"model": "exact-llm", "max_tokens": 50, "messages": QUESTION}
    headers = {"authorization": f"Bearer {KEY}"}
    return httpx.post(url + route, json=body, headers=headers, timeout=10)


def billed(ledger: Path, request_id: str) -> tuple[int, int, str | None]:
    """What the ledger billed the request, once its record is written (within 10 s)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        records = ledger_records(ledger, 0)
        found = [r for r in records if r.request_id == request_id and not r.checkpoint]
        if found:
            return found[0].input_tokens, found[0].output_tokens, found[0].usage_source
        time.sleep(0.05)
    raise AssertionError(f"no record of {request_id}")


@pytest.mark.parametrize(
    ("route", "usage"),
    [("/v1/messages", usage) for usage in BAD]
    + [("/v1/responses", usage) for usage in BAD if "cache_read_input_tokens" not in usage],
)
def test_unbelievable_usage_bills_the_gateways_exact_counts(
    setup: tuple[UsageLiar, str, Path], route: str, usage: dict[str, object]
) -> None:
    liar, url, ledger = setup
    liar.usage = usage
    answer = ask(url, route)
    assert answer.status_code == 200  # the client still gets its answer, unchanged
    counter = load_counter(qwen_spec(), model="exact-llm")
    expected = (counter.count_chat(QUESTION), counter.count_text(ANSWER), "counted")
    assert billed(ledger, answer.headers["x-request-id"]) == expected


@pytest.mark.parametrize(
    ("route", "usage", "expected"),
    [
        ("/v1/responses", {"input_tokens": 9, "output_tokens": 12, "total_tokens": 21}, (9, 12)),
        (
            "/v1/messages",
            {"input_tokens": 3, "output_tokens": 12, "cache_read_input_tokens": 6},
            (9, 12),
        ),
    ],
)
def test_believable_usage_is_the_bill(
    setup: tuple[UsageLiar, str, Path],
    route: str,
    usage: dict[str, object],
    expected: tuple[int, int],
) -> None:
    liar, url, ledger = setup
    liar.usage = usage
    answer = ask(url, route)
    assert billed(ledger, answer.headers["x-request-id"]) == (*expected, "backend")


@pytest.mark.parametrize(
    ("start", "delta", "expected"),
    [
        # a count lowered at the end is not believed: the stream's counts are cumulative
        (
            {"input_tokens": 40, "output_tokens": 1},
            {"input_tokens": 0, "output_tokens": 12},
            (40, 12),
        ),
        (
            {"input_tokens": 3, "cache_read_input_tokens": 37, "output_tokens": 1},
            {"cache_read_input_tokens": 0, "output_tokens": 12},
            (40, 12),
        ),
        # vLLM's: message_start says 0 input, message_delta the real count
        (
            {"input_tokens": 0, "output_tokens": 0},
            {"input_tokens": 40, "output_tokens": 12},
            (40, 12),
        ),
    ],
)
def test_a_messages_streams_usage_is_read_as_cumulative(
    setup: tuple[UsageLiar, str, Path],
    start: dict[str, object],
    delta: dict[str, object],
    expected: tuple[int, int],
) -> None:
    """The client reads the stream as it came, through the anthropic SDK; the bill takes no
    count lower than the backend gave before."""
    liar, url, ledger = setup
    liar.start_usage, liar.usage = start, delta
    client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
    with (
        client,
        client.messages.stream(model="exact-llm", max_tokens=50, messages=QUESTION) as stream,
    ):
        request_id = stream.response.headers["x-request-id"]
        assert "".join(stream.text_stream) == "".join(WORDS)
    assert billed(ledger, request_id) == (*expected, "backend")


def test_a_tool_input_nested_past_what_orjson_writes_is_counted_and_settled(
    setup: tuple[UsageLiar, str, Path],
) -> None:
    """A whole message without usage is billed from its counted content; a tool call's input
    300 levels deep (which the gateway reads but orjson cannot write) made that count raise: the
    client got a 200 head and a dropped connection, nothing was billed, and the key's slot was
    never given back (every later request of a max_concurrent: 1 key was a 429)."""
    liar, url, ledger = setup
    deep = "[" * 300 + "]" * 300
    liar.usage = {"input_tokens": 9}  # no output count: the content is counted
    tool_use = b'{"type":"tool_use","id":"t1","name":"f","input":{"a":' + deep.encode() + b"}}"
    liar.raw = {"content": b"[" + tool_use + b"]"}
    try:
        client = anthropic.Anthropic(base_url=url, api_key=SINGLE_KEY, max_retries=0)
        with client:
            raw = client.messages.with_raw_response.create(
                model="exact-llm", max_tokens=50, messages=QUESTION
            )
            assert raw.parse().content[0].type == "tool_use"
            counter = load_counter(qwen_spec(), model="exact-llm")
            output = counter.count_text("f") + counter.count_text('{"a":' + deep + "}")
            expected = (counter.count_chat(QUESTION), output, "counted")
            assert billed(ledger, raw.headers["x-request-id"]) == expected
            liar.raw = {}
            again = client.messages.create(model="exact-llm", max_tokens=50, messages=QUESTION)
            assert again.content[0].type == "text"  # the slot was given back
    finally:
        liar.raw = {}


@pytest.mark.parametrize("route", ["/v1/messages", "/v1/responses"])
def test_a_usage_number_nested_past_what_orjson_writes_is_logged_and_not_believed(
    setup: tuple[UsageLiar, str, Path], route: str
) -> None:
    """The warning that names an unbelievable usage wrote its numbers with orjson: one nested
    300 levels deep raised there, and the client got a 200 head and a dropped connection."""
    liar, url, ledger = setup
    deep = b"[" * 300 + b"]" * 300
    liar.raw = {"usage": b'{"input_tokens":' + deep + b',"output_tokens":12}'}
    try:
        answer = ask(url, route)
    finally:
        liar.raw = {}
    assert answer.status_code == 200
    counter = load_counter(qwen_spec(), model="exact-llm")
    expected = (counter.count_chat(QUESTION), counter.count_text(ANSWER), "counted")
    assert billed(ledger, answer.headers["x-request-id"]) == expected
