"""Workers' metrics summed on a scrape: counters and histograms of every worker, dead ones too
(folded into one archive); in-flight streams of live workers only. (A real `serve --workers 2`
across restarts: tests/test_cli_workers.py.)"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.ledger.base import LedgerStats
from proxy.telemetry.metrics import GatewayMetrics
from proxy.telemetry.sample import RequestSample
from proxy.telemetry.workershare import ARCHIVE, PUBLISH_S, WorkerShare
from proxy.upstream.meter import GapHistogram

LABELS = ("alpha", "chat", "mock-llm", "mock", "2xx")


def _sample(output_tokens: int, cache: str = "miss") -> RequestSample:
    gaps = GapHistogram()
    for _ in range(output_tokens - 1):
        gaps.add(0.004)
    return RequestSample(
        labels=LABELS, input_tokens=10, output_tokens=output_tokens, cost_nusd=500_000_000,
        duration_s=0.2, gateway_s=0.001, upstream_s=0.19, upstream_ttft_s=0.01, ttft_s=0.02,
        time_per_token_s=0.004, gaps=gaps, cache=cache, saved_tokens=(0, 0), saved_nusd=0,
        rejected=None, degraded=(), error_type=None,
    )  # fmt: skip


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process that has exited."""
    ended = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(ended.stdout)


def _values(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
        if not s.name.startswith(("process_", "python_"))
    }


def _get(values: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    return sum(v for (n, _), v in values.items() if n == name)


@pytest.mark.anyio
async def test_a_scrape_sums_every_worker_as_one_process_would(tmp_path: Path) -> None:
    first, second = GatewayMetrics(WorkerShare(tmp_path)), GatewayMetrics(WorkerShare(tmp_path))
    alone = GatewayMetrics()  # one process that saw all of it
    for metrics, tokens in ((first, 3), (first, 40), (second, 7), (second, 300)):
        metrics.record(_sample(tokens))
        alone.record(_sample(tokens))
    second.record(_sample(5, cache="hit"))
    alone.record(_sample(5, cache="hit"))
    await asyncio.sleep(PUBLISH_S * 5)  # the first worker publishes on its own, soon
    whole = _values(second.render())
    assert whole == pytest.approx(_values(alone.render()))
    assert _get(whole, "tokenweir_requests_total") == 5
    assert _get(whole, "gen_ai_client_token_usage_count") == 10  # input and output, 5 each
    assert _values(first.render()) == pytest.approx(whole)  # whichever worker answers


@pytest.mark.anyio
async def test_a_dead_worker_keeps_its_counts_but_not_its_streams(
    tmp_path: Path, dead_pid: int
) -> None:
    share = WorkerShare(tmp_path)
    worker, survivor = GatewayMetrics(share), GatewayMetrics(WorkerShare(tmp_path))
    worker.record(_sample(4))
    worker.stream_started("alpha", "mock-llm")
    survivor.stream_started("alpha", "mock-llm")
    worker.render()  # a scrape publishes the answering worker's figures too
    inflight = _get(_values(survivor.render()), "tokenweir_inflight_streams")
    assert inflight == 2
    # The worker dies: its file now names a process that no longer exists.
    share.path.rename(tmp_path / f"{dead_pid}-dead.json")
    whole = _values(survivor.render())
    assert _get(whole, "tokenweir_requests_total") == 1  # counters never go backwards
    assert _get(whole, "tokenweir_inflight_streams") == 1  # only the survivor's stream


@pytest.mark.anyio
async def test_a_dead_workers_file_is_folded_into_the_archive_once(
    tmp_path: Path, dead_pid: int
) -> None:
    """A scrape folds a dead worker's file (and a write it left half done) into the archive
    and removes it; the file found again (its folder killed before removing it) is not counted
    twice, and a second dead worker's counts join the first's."""
    survivor_share = WorkerShare(tmp_path)
    survivor = GatewayMetrics(survivor_share)
    for name, total in (("first", 1), ("second", 2)):
        share = WorkerShare(tmp_path)
        GatewayMetrics(share).record(_sample(4))
        await asyncio.sleep(PUBLISH_S * 5)  # it publishes on its own, soon
        dead = share.path.rename(tmp_path / f"{dead_pid}-{name}.json")  # and dies
        half_written = tmp_path / f"{dead.name}.{dead_pid}.partial"
        half_written.write_bytes(b"{")
        left = dead.read_bytes()
        assert _get(_values(survivor.render()), "tokenweir_requests_total") == total
        assert not dead.exists()
        assert not half_written.exists()
        dead.write_bytes(left)
        assert _get(_values(survivor.render()), "tokenweir_requests_total") == total
    assert _names(tmp_path) == sorted([".lock", ARCHIVE, survivor_share.path.name])


@pytest.mark.anyio
async def test_a_dead_worker_that_cannot_be_folded_is_still_counted(
    tmp_path: Path, dead_pid: int, caplog: pytest.LogCaptureFixture
) -> None:
    """The archive cannot be written (here a directory is in its place; a full disk): the
    dead worker's file stays and is read as it is, and the failure is logged."""
    (tmp_path / ARCHIVE).mkdir()
    share = WorkerShare(tmp_path)
    GatewayMetrics(share).record(_sample(4))
    await asyncio.sleep(PUBLISH_S * 5)  # it publishes on its own, soon
    dead = share.path.rename(tmp_path / f"{dead_pid}-dead.json")  # and dies
    survivor = GatewayMetrics(WorkerShare(tmp_path))
    assert _get(_values(survivor.render()), "tokenweir_requests_total") == 1
    assert _names(tmp_path).count(dead.name) == 1
    assert "cannot fold dead workers' metrics" in caplog.text


def _names(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


@pytest.mark.anyio
async def test_a_worker_no_scrape_reaches_still_shows_its_ledgers_last_writes(
    tmp_path: Path,
) -> None:
    """A worker publishes soon after its last request, usually before its ledger has written
    that request's record; the kernel may then hand every scrape to the other worker, which must
    still see the record written once it is (the loaded run's flake of stop 58)."""
    stats = LedgerStats(appended=1, written=0, dropped=0, buffered=1, write_failures=0,
                        last_error=None)  # fmt: skip
    worker, scraped = GatewayMetrics(WorkerShare(tmp_path)), GatewayMetrics(WorkerShare(tmp_path))
    worker.watch_ledger(lambda: stats)
    worker.record(_sample(3))
    await asyncio.sleep(PUBLISH_S * 5)  # published: the record is not written yet
    assert _get(_values(scraped.render()), "tokenweir_requests_total") == 1
    stats = LedgerStats(appended=1, written=1, dropped=0, buffered=0, write_failures=0,
                        last_error=None)  # fmt: skip  # the writer's turn came; no request since
    await asyncio.sleep(PUBLISH_S * 5)
    assert _get(_values(scraped.render()), "tokenweir_ledger_records_written_total") == 1
