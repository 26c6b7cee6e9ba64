"""`tokenweir bench` end to end against the mock backend: accuracy, errors, CLI, JSON, plot."""

from __future__ import annotations

import argparse
import asyncio
import itertools
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from proxy.tools.bench.config import open_files_limit
from proxy.tools.bench.run import BenchConfig, LevelResult, add_arguments, main, run_level
from proxy.tools.bench.stats import summarize
from proxy.tools.mock.backend import create_app
from tests.servers import serve
from tests.tools.backendclock import BackendClock, worst_stall

TTFT_S = 0.2
TOKENS_PER_S = 100.0


def p50(values: list[float]) -> float:
    """The median as the bench computes it."""
    median = summarize(values).p50
    assert median is not None
    return median


def within(measured: float | None, expected: float, tolerance: float, slack_s: float) -> bool:
    return measured is not None and abs(measured - expected) <= tolerance * expected + slack_s


def level(base_url: str, concurrency: int, **settings: object) -> LevelResult:
    config = BenchConfig(base_url=base_url, model="mock-llm", **settings)  # type: ignore[arg-type]
    return asyncio.run(run_level(config, concurrency))


@pytest.fixture(scope="module")
def paced_server() -> Iterator[tuple[str, BackendClock]]:
    backend = BackendClock(create_app(ttft_ms=TTFT_S * 1000, tokens_per_second=TOKENS_PER_S))
    with serve(backend) as base_url:
        yield base_url, backend


@pytest.fixture
def paced_backend(paced_server: tuple[str, BackendClock]) -> tuple[str, BackendClock]:
    paced_server[1].timelines.clear()
    return paced_server


@pytest.mark.parametrize(("concurrency", "http_client"), [(1, "raw"), (4, "raw"), (1, "httpx")])
def test_configured_ttft_and_speed_read_back_within_5_percent(
    paced_backend: tuple[str, BackendClock], concurrency: int, http_client: str
) -> None:
    """The bench reads back what the backend's own clock saw it do: within 5% on an idle
    machine, widened by the longest stall seen during the run once per request in flight
    and once more (a loaded machine delays the bench's reads, and requests queue behind each
    other). Never less than the backend's TTFT and duration: the bytes cannot come earlier."""
    url, backend = paced_backend
    with worst_stall() as stall:
        result = level(url, concurrency, requests=4, max_tokens=40, http_client=http_client)
    assert (result.ok, result.errors) == (4, {})
    assert result.token_source == "usage"
    assert result.output_tokens == 4 * 40
    assert result.verdict == "50-150 tok/s: readable streaming"
    lines, slack_s = backend.timelines, (concurrency + 1) * stall[0]
    ttft_s, e2e_s = p50([t.ttft_s for t in lines]), p50([t.e2e_s for t in lines])
    assert (result.ttft_s.p50 or 0) >= ttft_s
    assert (result.e2e_s.p50 or 0) >= e2e_s
    assert within(result.ttft_s.p50, ttft_s, 0.05, slack_s), (result.ttft_s, ttft_s, slack_s)
    assert within(result.e2e_s.p50, e2e_s, 0.05, slack_s), (result.e2e_s, e2e_s, slack_s)
    # Speed is 39 gaps over a span: the slack, a time, widens the span, not the speed.
    speeds = [39 / t.span_s for t in lines]
    for measured, backend_speed in (
        (result.stream_tokens_per_s.p50, p50(speeds)),
        (result.stream_tokens_per_s.p10, summarize(speeds).p10 or 0.0),
    ):
        assert measured is not None
        assert within(39 / measured, 39 / backend_speed, 0.05, slack_s), (measured, slack_s)
    itl_s = p50(list(itertools.chain.from_iterable(t.gaps_s() for t in lines)))
    assert within(result.itl_s.p50, itl_s, 0.10, slack_s), (result.itl_s, itl_s, slack_s)
    # `concurrency` requests run at once, so the level lasts 4 / concurrency requests' time.
    wall_s = max(t.writes[-1][0] for t in lines) - min(t.arrived_s for t in lines)
    rounds = 4 // concurrency
    assert within(160 / result.aggregate_tokens_per_s, wall_s, 0.10, rounds * slack_s)


def test_non_streaming_level(paced_backend: tuple[str, BackendClock]) -> None:
    url, backend = paced_backend
    with worst_stall() as stall:
        result = level(url, 2, requests=2, max_tokens=20, stream=False)
    assert (result.ok, result.output_tokens, result.token_source) == (2, 40, "usage")
    assert result.ttft_s.count == 0
    assert result.verdict.startswith("n/a")
    e2e_s = p50([t.e2e_s for t in backend.timelines])
    assert (result.e2e_s.p50 or 0) >= e2e_s
    assert within(result.e2e_s.p50, e2e_s, 0.10, 3 * stall[0]), (result.e2e_s, e2e_s, stall)


@pytest.fixture(scope="module")
def fast_backend() -> Iterator[str]:
    with serve(create_app(ttft_ms=5, tokens_per_second=2000)) as base_url:
        yield base_url


def test_errors_are_counted_by_kind(fast_backend: str) -> None:
    refused = level(fast_backend, 2, requests=3, max_tokens=5, extra_body={"mock_fail": 429})
    assert (refused.ok, refused.errors) == (0, {"http_429": 3})
    assert refused.error_examples["http_429"]
    cut = level(fast_backend, 2, requests=2, extra_body={"mock_fail_after_tokens": 3})
    assert (cut.ok, cut.errors) == (0, {"connection": 2})


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tokenweir bench")
    add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_writes_json_and_prints_the_table(
    paced_server: tuple[str, BackendClock], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Paced: ten tokens at 2,000/s can reach a loaded client in one read, which has no speed.
    url, _ = paced_server
    out = tmp_path / "bench.json"
    argv = ["--base-url", url, "--model", "mock-llm", "--api-key", "sk-secret"]
    argv += ["--concurrency", "1,2", "--requests", "3", "--max-tokens", "10"]
    argv += ["--input-tokens", "32", "--json", str(out), "--progress"]
    assert main(parse(argv)) == 0
    captured = capsys.readouterr()
    assert "TTFT p50/p90/p99 ms" in captured.out
    assert "concurrency 2: median stream speed" in captured.out
    assert "\rconcurrency 1: 3/3 done" in captured.err
    text = out.read_text(encoding="utf-8")
    assert "sk-secret" not in text
    document = orjson.loads(text)
    assert document["config"]["api_key"] == "set"
    assert document["config"]["concurrency"] == [1, 2]
    assert [lv["concurrency"] for lv in document["levels"]] == [1, 2]
    for result in document["levels"]:
        assert (result["requests"], result["ok"], result["output_tokens"]) == (3, 3, 30)
        assert result["token_source"] == "usage"
        assert result["ttft_s"]["count"] == 3
        assert result["stream_tokens_per_s"]["p50"] > 0
    stats = httpx.get(f"{url}/mock/stats").json()
    assert stats["last_authorization"] == "Bearer sk-secret"
    assert stats["last_request"]["stream_options"] == {"include_usage": True}


def test_cli_plot(fast_backend: str, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    argv = ["--base-url", fast_backend, "--model", "mock-llm", "--concurrency", "1,2"]
    argv += ["--requests", "2", "--max-tokens", "5", "--plot", str(png)]
    assert main(parse(argv)) == 0
    assert png.read_bytes().startswith(b"\x89PNG")


def test_cli_exit_status_for_bad_input_and_for_total_failure(
    fast_backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--base-url", fast_backend, "--model", "mock-llm", "--concurrency", "1"]
    assert main(parse([*base, "--duration", "soon"])) == 2
    assert "duration 'soon'" in capsys.readouterr().err
    failing = [*base, "--requests", "1", "--extra-body", '{"mock_fail": 503}']
    assert main(parse(failing)) == 1
    assert "1 x http_503" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--base-url", "http://127.0.0.1:99999/v1"], "Port out of range"),
        (["--base-url", "http://127.0.0.1:abc/v1"], "Port could not be cast"),
        (["--base-url", "http://[::1/v1"], "Invalid IPv6 URL"),
        (["--base-url", "http://:8000/v1"], "is not an http(s) URL"),
        (["--concurrency", "\u00b2"], "concurrency '\u00b2' is not a positive integer"),
        (["--input-tokens", "2000001"], "--input-tokens must be at most 2,000,000"),
        # A header of its own in every request; a UnicodeEncodeError traceback.
        (["--api-key", "k\r\nX-Injected: 1"], "--api-key (or $OPENAI_API_KEY) must be printable"),
        (["--api-key", "\u043a\u043b\u044e\u0447"], "must be printable ASCII"),
    ],
)
def test_bad_flags_are_a_message_not_a_traceback(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Each was a ValueError's traceback.
    args = ["--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--requests", "1", *flags]
    assert main(parse(args)) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenweir bench: ")
    assert message in err


def test_a_level_past_the_open_files_limit_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # Once it ran, its connections failing as "connection" errors (or, at 10**13, never ended
    # making workers): each request in flight holds a socket.
    files = open_files_limit()
    if files is None:
        pytest.skip("no open-files limit here")
    args = ["--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--requests", "1"]
    assert main(parse([*args, "--concurrency", f"1,{files + 1}"])) == 2
    assert f"concurrency {files + 1} needs a socket for each request" in capsys.readouterr().err


def test_duration_mode_stops_starting_requests_at_the_deadline(fast_backend: str) -> None:
    result = level(fast_backend, 2, duration_s=0.3, max_tokens=5)
    assert result.ok >= 2
    assert result.errors == {}
    # The requests started before the deadline end in milliseconds on an idle machine; the
    # bound only has to tell stopping from carrying on, so it leaves a loaded one seconds.
    assert result.wall_s < 0.3 + 3.0
