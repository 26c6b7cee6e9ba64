"""`tokenweir bench` end to end against the mock backend: accuracy, errors, CLI, JSON, plot."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from proxy.tools.bench import BenchConfig, LevelResult, add_arguments, main, run_level
from proxy.tools.mockbackend import create_app
from tests.servers import serve

TTFT_S = 0.2
TOKENS_PER_S = 100.0


def within(measured: float | None, expected: float, tolerance: float) -> bool:
    return measured is not None and abs(measured - expected) <= tolerance * expected


def level(base_url: str, concurrency: int, **settings: object) -> LevelResult:
    config = BenchConfig(base_url=base_url, model="mock-llm", **settings)  # type: ignore[arg-type]
    return asyncio.run(run_level(config, concurrency))


@pytest.fixture(scope="module")
def paced_backend() -> Iterator[str]:
    with serve(create_app(ttft_ms=TTFT_S * 1000, tokens_per_second=TOKENS_PER_S)) as base_url:
        yield base_url


@pytest.mark.parametrize(("concurrency", "http_client"), [(1, "raw"), (4, "raw"), (1, "httpx")])
def test_configured_ttft_and_speed_read_back_within_5_percent(
    paced_backend: str, concurrency: int, http_client: str
) -> None:
    result = level(paced_backend, concurrency, requests=4, max_tokens=40, http_client=http_client)
    assert (result.ok, result.errors) == (4, {})
    assert result.token_source == "usage"
    assert result.output_tokens == 4 * 40
    assert within(result.ttft_s.p50, TTFT_S, 0.05), result.ttft_s
    assert within(result.stream_tokens_per_s.p50, TOKENS_PER_S, 0.05), result.stream_tokens_per_s
    assert within(result.stream_tokens_per_s.p10, TOKENS_PER_S, 0.05), result.stream_tokens_per_s
    assert within(result.itl_s.p50, 1 / TOKENS_PER_S, 0.10), result.itl_s
    # each request takes TTFT + 39 gaps; `concurrency` of them run at once
    e2e_s = TTFT_S + 39 / TOKENS_PER_S
    assert within(result.e2e_s.p50, e2e_s, 0.05), result.e2e_s
    assert within(result.aggregate_tokens_per_s, 40 * concurrency / e2e_s, 0.10)
    assert result.verdict == "50-150 tok/s: readable streaming"


def test_non_streaming_level(paced_backend: str) -> None:
    result = level(paced_backend, 2, requests=2, max_tokens=20, stream=False)
    assert (result.ok, result.output_tokens, result.token_source) == (2, 40, "usage")
    assert result.ttft_s.count == 0
    assert result.verdict.startswith("n/a")
    assert within(result.e2e_s.p50, TTFT_S + 19 / TOKENS_PER_S, 0.10), result.e2e_s


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
    fast_backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    argv = ["--base-url", fast_backend, "--model", "mock-llm", "--api-key", "sk-secret"]
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
    stats = httpx.get(f"{fast_backend}/mock/stats").json()
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


def test_duration_mode_stops_starting_requests_at_the_deadline(fast_backend: str) -> None:
    result = level(fast_backend, 2, duration_s=0.3, max_tokens=5)
    assert result.ok >= 2
    assert result.errors == {}
    assert result.wall_s < 1.0
