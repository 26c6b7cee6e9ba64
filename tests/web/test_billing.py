"""What each request bills, end to end: backend numbers checked, refusals free, statuses real.

A backend that lies about usage (tests/web/lyingbackend.py), the real mock backend, a real
gateway with a SQLite ledger, the access log and /api/usage: what a user and an operator see.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from proxy.app import create_app
from proxy.ledger import UsageRecord, open_ledger
from proxy.policy import Policy, parse_policy
from proxy.policy.units import hash_key
from proxy.tokens import load_counter
from tests.conftest import ADMIN_KEY, ALPHA_KEY
from tests.servers import free_port, serve
from tests.shared import tokenizer_file
from tests.web.lyingbackend import WORD, WORDS, LyingBackend, lying_backend

AUTH = {"authorization": f"Bearer {ALPHA_KEY}"}
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
HELLO = [{"role": "user", "content": "Say hello twelve times."}]


def qwen_spec() -> str:
    return f"{tokenizer_file('qwen2.5/qwen.tiktoken')}#qwen2.5"


def billing_policy(
    backend_url: str, ledger: Path, *, quota: int = 10**6, cache: str = "off"
) -> Policy:
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there: connect refused
    text = f"""
storage: memory
admin_keys: [{hash_key(ADMIN_KEY)}]
ledger: sqlite:///{ledger}
upstream: {{connect_timeout: 2s, read_timeout: 5s}}
backends:
  - name: liar
    url: {backend_url}/v1
    models: [exact-llm, guess-llm]
  - name: gone
    url: {closed}/v1
    models: [nowhere-llm]
models:
  exact-llm: {{tokenizer: "{qwen_spec()}", price: {{input_per_1m: 1.0, output_per_1m: 2.0}}}}
  guess-llm: {{price: {{input_per_1m: 1.0, output_per_1m: 2.0}}}}
  nowhere-llm: {{price: {{input_per_1m: 1.0, output_per_1m: 2.0}}}}
tenants:
  alpha:
    api_keys: [{hash_key(ALPHA_KEY)}]
    models: [exact-llm, guess-llm, nowhere-llm]
    budget: {{tokens_per_day: {quota}}}
    cache: {{mode: "{cache}"}}
"""
    return parse_policy(text, file="billing.yaml", environ={})


@pytest.fixture
def liar() -> Iterator[tuple[LyingBackend, str]]:
    with lying_backend() as found:
        yield found


@pytest.fixture
def ledger_path(tmp_path: Path) -> Path:
    return tmp_path / "ledger.db"


@pytest.fixture
def gateway(liar: tuple[LyingBackend, str], ledger_path: Path) -> Iterator[str]:
    with serve(create_app(billing_policy(liar[1], ledger_path))) as url:
        yield url


def ledger_records(path: Path, count: int) -> list[UsageRecord]:
    """The ledger's newest records, oldest first, once it holds `count` of them."""

    async def read() -> list[UsageRecord]:
        ledger = open_ledger(f"sqlite:///{path}", read_only=True)
        await ledger.start()
        try:
            return await ledger.latest(None, 1000)
        finally:
            await ledger.aclose()

    deadline = time.monotonic() + 5
    while True:
        found = asyncio.run(read()) if path.exists() else []
        if len(found) >= count or time.monotonic() > deadline:
            return found[::-1]
        time.sleep(0.05)


def chat(url: str, model: str = "exact-llm", **body: object) -> httpx.Response:
    payload = {"model": model, "messages": HELLO, **body}
    return httpx.post(url + "/v1/chat/completions", json=payload, headers=AUTH, timeout=10)


def streamed(url: str, model: str = "exact-llm", **body: object) -> str:
    payload = {"model": model, "messages": HELLO, "stream": True, **body}
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=payload, headers=AUTH, timeout=10
    ) as answer:
        assert answer.status_code == 200
        return answer.read().decode()


def exact_output(n: int = 1) -> int:
    counter = load_counter(qwen_spec(), model="exact-llm")
    return n * counter.count_text(WORD * WORDS)


BAD_USAGE = [
    b'{"prompt_tokens": 9, "completion_tokens": 18446744073709551615, "total_tokens": 9}',
    b'{"prompt_tokens": -100000, "completion_tokens": 12, "total_tokens": -99988}',
    b'{"prompt_tokens": true, "completion_tokens": true, "total_tokens": 2}',
    b'{"prompt_tokens": 9.0, "completion_tokens": 12.5}',
    b'{"prompt_tokens": "9", "completion_tokens": 12}',
    b'{"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 1e30}',
    # deeper than orjson writes: the warning naming the backend's numbers raised on it
    b'{"prompt_tokens": ' + b"[" * 300 + b"]" * 300 + b', "completion_tokens": 12}',
]


@pytest.mark.parametrize("usage", BAD_USAGE)
@pytest.mark.parametrize("stream", [False, True])
def test_unbelievable_backend_usage_bills_the_gateways_own_counts(
    liar: tuple[LyingBackend, str], gateway: str, ledger_path: Path, usage: bytes, stream: bool
) -> None:
    backend, _ = liar
    assert chat(gateway).status_code == 200  # an honest record first, in the same ledger
    backend.usage = usage
    if stream:
        streamed(gateway)
    else:
        assert chat(gateway).status_code == 200
    backend.usage = b'{"prompt_tokens": 9, "completion_tokens": 12}'
    assert chat(gateway).status_code == 200  # the tenant is not locked out, nor credited
    honest, lied, after = ledger_records(ledger_path, 3)
    assert honest.usage_source == after.usage_source == "backend"
    assert (honest.input_tokens, honest.output_tokens) == (9, 12)
    assert lied.usage_source == "counted"
    assert lied.input_tokens == lied.counted_input_tokens > 0
    if stream:  # token events: each word (a word a token), not the finish event
        assert lied.output_tokens == WORDS
    else:
        assert lied.output_tokens == exact_output()
    assert 0 < lied.cost_nusd < 10**6


@pytest.mark.parametrize("stream", [False, True])
def test_more_output_reported_than_the_request_was_bound_to_is_not_believed(
    liar: tuple[LyingBackend, str], gateway: str, ledger_path: Path, stream: bool
) -> None:
    """12 words answered under `max_tokens: 20`, reported as 5,000 tokens (a whole day's quota
    for many tenants): the bound the backend was sent is the most it can have generated."""
    backend, _ = liar
    backend.usage = b'{"prompt_tokens": 9, "completion_tokens": 5000}'
    if stream:
        streamed(gateway, max_tokens=20)
    else:
        assert chat(gateway, max_tokens=20).status_code == 200
    backend.usage = b'{"prompt_tokens": 9, "completion_tokens": 20}'  # at the bound: believed
    assert chat(gateway, max_tokens=20).status_code == 200
    lied, at_bound = ledger_records(ledger_path, 2)
    assert lied.usage_source == "counted"
    assert lied.output_tokens == (WORDS if stream else exact_output())
    assert (at_bound.usage_source, at_bound.output_tokens) == ("backend", 20)


@pytest.mark.parametrize("stream", [False, True])
def test_two_choices_bill_what_was_relayed_not_the_one_choice_reported(
    liar: tuple[LyingBackend, str], gateway: str, ledger_path: Path, stream: bool
) -> None:
    backend, _ = liar
    one_choice = exact_output()
    backend.usage = b'{"prompt_tokens": 9, "completion_tokens": %d}' % one_choice
    if stream:
        streamed(gateway, n=2)
    else:
        assert chat(gateway, n=2).status_code == 200
    [record] = ledger_records(ledger_path, 1)
    assert record.usage_source == "counted_output"
    assert record.input_tokens == 9
    if stream:
        assert 2 * WORDS - 2 <= record.output_tokens <= 2 * WORDS + 2
    else:
        assert record.output_tokens == exact_output(2)


def test_an_honest_stream_bills_exactly_the_backends_usage(
    liar: tuple[LyingBackend, str], gateway: str, ledger_path: Path
) -> None:
    streamed(gateway)
    [record] = ledger_records(ledger_path, 1)
    assert record.usage_source == "backend"
    assert (record.input_tokens, record.output_tokens) == (9, 12)


@pytest.mark.parametrize("framing", ["mixed", "multiline"])
def test_a_stream_framed_as_the_spec_allows_bills_the_backends_usage(
    liar: tuple[LyingBackend, str], gateway: str, ledger_path: Path, framing: str
) -> None:
    """Line ends that change from LF to CRLF mid-stream, or each event's JSON over two `data:`
    lines: the client gets every word and no usage chunk it did not ask for, and the bill is
    the backend's usage (mixed line ends held the stream to its end and billed 0 output;
    each `data:` line was counted a token, so 12 tokens were billed as 25)."""
    backend, _ = liar
    backend.framing = framing
    text = streamed(gateway)
    assert text.count("hello") == WORDS
    assert '"usage"' not in text
    [record] = ledger_records(ledger_path, 1)
    assert record.usage_source == "backend"
    assert (record.input_tokens, record.output_tokens) == (9, 12)


def test_requests_refused_before_the_backend_bill_nothing(
    liar: tuple[LyingBackend, str],
    gateway: str,
    ledger_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    backend, _ = liar
    unknown = "x" * 100_000
    assert chat(gateway, model=unknown).status_code == 404
    assert chat(gateway, model="nowhere-llm").status_code == 502  # connect refused
    backend.status = 400  # the backend refuses the prompt (say, too long)
    assert chat(gateway).status_code == 400
    bad_key = {"authorization": "Bearer nope"}
    payload = {"model": "exact-llm", "messages": HELLO}
    refused = httpx.post(gateway + "/v1/chat/completions", json=payload, headers=bad_key)
    assert refused.status_code == 401
    records = ledger_records(ledger_path, 4)
    by_model = httpx.get(gateway + "/api/usage?since=1d&group_by=model", headers=ADMIN)
    page = httpx.get(gateway + "/dashboard/tenants/alpha", headers=ADMIN)
    assert [r.status for r in records] == [404, 502, 400, 401]
    assert {row["model"] for row in by_model.json()["data"]} >= {"<unknown>"}
    assert len(by_model.content) < 10_000
    assert "x" * 100 not in page.text
    logged = [r.getMessage() for r in caplog.records if r.name == "tokenweir.access"]
    assert len(logged) == 4
    assert all(len(line) < 2000 for line in logged)
    first = orjson.loads(logged[0])
    assert (first["model"], first["usage_source"], first["input_tokens"]) == ("<unknown>", None, 0)
    assert len(first["model_requested"]) <= 64
    for record in records:
        assert (record.input_tokens, record.output_tokens, record.cost_nusd) == (0, 0, 0)
        assert record.usage_source is None
    assert records[0].model == "<unknown>"
    assert records[1].counted_input_tokens > 0  # counted for the quota, kept for analysis
    assert records[2].counted_input_tokens > 0


def test_a_quota_refusal_bills_nothing_and_the_bar_matches_the_quota(
    liar: tuple[LyingBackend, str], ledger_path: Path
) -> None:
    _, url = liar
    with serve(create_app(billing_policy(url, ledger_path, quota=100))) as gateway:
        statuses = [chat(gateway, max_tokens=40).status_code for _ in range(6)]
        assert statuses[0] == 200
        assert 429 in statuses
        records = ledger_records(ledger_path, 6)
        billed = sum(r.input_tokens + r.output_tokens for r in records)
        assert billed == 21 * statuses.count(200)  # 9 + 12 each, refusals nothing
        refused = [r for r in records if r.status == 429]
        assert all(r.cost_nusd == 0 and r.counted_input_tokens > 0 for r in refused)
        usage = httpx.get(gateway + "/api/usage?since=1d", headers=ADMIN).json()["data"]
        [row] = usage
        assert row["input_tokens"] + row["output_tokens"] == billed


def test_cache_hits_measure_their_own_time(
    liar: tuple[LyingBackend, str], ledger_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    policy = billing_policy(liar[1], ledger_path, cache="exact")
    with serve(create_app(policy)) as gateway:
        for _ in range(3):
            assert chat(gateway, temperature=0).status_code == 200
        streamed(gateway, temperature=0)
        streamed(gateway, temperature=0)
        metrics = httpx.get(gateway + "/metrics").text
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "tokenweir.access"]
    hits = [line for line in lines if line["cache"] == "hit"]
    assert len(hits) >= 3
    for hit in hits:
        assert hit["completed"] is True
        assert 0 < hit["gateway_ms"] <= hit["duration_ms"] < 10_000
    overhead = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("tokenweir_gateway_overhead_seconds_sum")
    ]
    assert overhead
    assert sum(overhead) < 60  # five requests; the clock's epoch made it millions


def test_an_internal_error_is_recorded_as_a_500(ledger_path: Path) -> None:
    class Broken(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            raise RuntimeError("a bug below the relay")

    policy = billing_policy("http://127.0.0.1:9", ledger_path)
    with serve(create_app(policy, transport=Broken())) as gateway:
        answer = chat(gateway)
    assert answer.status_code == 500
    # OpenAI-shaped: the app's handler answers it, from the inference routes' fast lane too,
    # with the request's id as every other answer has.
    assert answer.json()["error"]["code"] == "internal_error"
    assert answer.headers["x-request-id"].startswith("req_")
    [record] = ledger_records(ledger_path, 1)
    assert (record.status, record.error) == (500, "internal_error")
    assert (record.input_tokens, record.cost_nusd) == (0, 0)


def test_a_client_that_leaves_before_the_answer_is_recorded_as_499(
    backend_url: str, ledger_path: Path
) -> None:
    from tests.conftest import make_policy

    policy = make_policy(backend_url, extra=f"ledger: sqlite:///{ledger_path}\n")
    long = {
        "model": "mock-llm",
        "messages": HELLO,
        "max_tokens": 20_000,
        "mock_completion_tokens": 20_000,
    }
    with serve(create_app(policy)) as gateway:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(gateway + "/v1/chat/completions", json=long, headers=AUTH, timeout=0.5)
        [record] = ledger_records(ledger_path, 1)
    assert (record.status, record.error) == (499, "client_closed")
    assert record.client_disconnected is True


def test_a_model_without_a_tokenizer_is_labelled_estimated(
    liar: tuple[LyingBackend, str], ledger_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    backend, url = liar
    with serve(create_app(billing_policy(url, ledger_path))) as gateway:
        warnings = [
            r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
            and "no tokenizer" in r.getMessage()
        ]  # fmt: skip
        assert len([w for w in warnings if "'guess-llm'" in w]) == 1
        assert not [w for w in warnings if "'exact-llm'" in w]
        backend.usage = None
        assert chat(gateway, model="guess-llm").status_code == 200
        assert chat(gateway, model="exact-llm").status_code == 200
        guessed, counted = ledger_records(ledger_path, 2)
        usage = httpx.get(gateway + "/api/usage?since=1d&group_by=model", headers=ADMIN).json()
    assert (guessed.usage_source, counted.usage_source) == ("estimated", "counted")
    by_model = {row["model"]: row for row in usage["data"]}
    assert by_model["guess-llm"]["estimated_requests"] == 1
    assert by_model["exact-llm"]["counted_requests"] == 1
    assert by_model["exact-llm"]["estimated_requests"] == 0
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "tokenweir.access"]
    assert [line["usage_source"] for line in lines] == ["estimated", "counted"]
