"""The bench's table notes, progress line and JSON document."""

from __future__ import annotations

import io

import orjson

from proxy.tools.bench.client import EVENTS, UNKNOWN, RequestSample
from proxy.tools.bench.config import BenchConfig
from proxy.tools.bench.level import LevelProgress, summarize_level
from proxy.tools.bench.prompts import Workload
from proxy.tools.bench.report import (
    ProgressLine,
    format_table,
    level_json,
    level_line,
    result_document,
)


def sample(tokens: int, *, error: str | None = None) -> RequestSample:
    result = RequestSample(start_s=0.0, end_s=1.0, error=error, output_tokens=tokens)
    result.first_token_s, result.last_token_s = 0.25, 0.25 + (tokens - 1) / 40
    result.token_source = EVENTS
    result.error_detail = "upstream said no" if error else None
    return result


def test_table_notes_speed_band_token_unit_errors_and_a_busy_client() -> None:
    samples = [sample(41), sample(41), sample(0, error="http_502")]
    level = summarize_level(8, samples, start_s=0.0, cpu_fraction=0.93)
    table = format_table([level])
    header, row = table.splitlines()[:2]
    assert header.split()[0] == "conc"
    assert row.split()[:3] == ["8", "2/1", "2.00"]
    assert "concurrency 8: median stream speed <50 tok/s: too slow for interactive use" in table
    assert "tokens counted from: events (no usage, no tokenizer)" in table
    assert "1 x http_502: upstream said no" in table
    assert "used 93% of a CPU core" in table


def test_quiet_client_gets_no_warning() -> None:
    level = summarize_level(1, [sample(41)], start_s=0.0, cpu_fraction=0.2)
    assert "warning" not in format_table([level])


def test_progress_line_rewrites_itself() -> None:
    stream = io.StringIO()
    line = ProgressLine(stream)
    progress = LevelProgress(concurrency=4, planned=16, started=6, finished=2, failed=1)
    line(progress)
    progress.finished = 3
    line(progress)
    line.end()
    text = stream.getvalue()
    assert text.count("\r") == 2
    assert "concurrency 4: 3/16 done, 1 failed, 3 in flight" in text
    assert text.endswith("\n")


def test_json_document_round_trips_and_hides_the_key() -> None:
    config = BenchConfig(base_url="http://h/v1", model="m", api_key="sk-live-123")
    level = summarize_level(1, [sample(41)], start_s=0.0, cpu_fraction=0.1)
    workload = Workload(bodies=(b"{}",), tokenizer=None, prompt_note="synthetic")
    encoded = orjson.dumps(result_document(config, workload, [level]))
    assert b"sk-live-123" not in encoded
    document = orjson.loads(encoded)
    assert document["config"]["api_key"] == "set"
    assert document["levels"][0]["stream_tokens_per_s"]["p50"] == 40.0
    assert document["levels"][0]["token_source"] == EVENTS


def test_uncounted_tokens_are_reported_as_unknown_never_as_zero() -> None:
    """Answers without usage and no tokenizer: no token figure anywhere, not 0 tok/s."""
    answers = [RequestSample(start_s=0.0, end_s=0.5), RequestSample(start_s=0.0, end_s=1.0)]
    level = summarize_level(2, answers, start_s=0.0, cpu_fraction=0.1)
    assert (level.ok, level.token_source) == (2, UNKNOWN)
    assert (level.output_tokens, level.aggregate_tokens_per_s) == (None, None)
    assert level_json(level)["aggregate_tokens_per_s"] is None
    assert format_table([level]).splitlines()[1].split()[6] == "-"
    assert level_line(level) == "concurrency 2: 2 ok, 0 failed in 1.0 s, tokens not counted"


def test_a_level_with_no_answer_names_no_token_source() -> None:
    failed = [sample(0, error="http_429")]
    table = format_table([summarize_level(1, failed, start_s=0.0, cpu_fraction=0.1)])
    assert "tokens counted from" not in table
    assert "1 x http_429" in table


def test_progress_line_of_uncounted_answers_shows_no_rate() -> None:
    stream = io.StringIO()
    progress = LevelProgress(concurrency=1, planned=4)
    progress.record(RequestSample(start_s=0.0, end_s=0.5))  # no usage, no tokenizer
    ProgressLine(stream)(progress)
    assert "tok/s" not in stream.getvalue()
    assert "tokens not counted" in stream.getvalue()
