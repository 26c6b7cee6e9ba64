"""Durability across processes: SIGTERM loses no acknowledged record; SIGKILL leaves no tear."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.ledger import UsageQuery, open_ledger
from tests.ledger.factory import DAY_S, T0

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).parents[2]
EVERYTHING = UsageQuery(None, T0 - DAY_S, T0 + DAY_S)


def run_appender(url: str, sig: signal.Signals, *, at_least: int) -> tuple[int, list[str]]:
    """Start the appender, signal it once it acknowledged `at_least` records; the last ack."""
    command = [sys.executable, "-m", "tests.ledger.appender", url]
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True) as child:
        assert child.stdout is not None
        acked = 0
        for line in child.stdout:
            if line.startswith("acked "):
                acked = int(line.split()[1])
                if acked >= at_least:
                    break
        child.send_signal(sig)
        rest = child.stdout.read().splitlines()
        child.wait(timeout=30)
    acks = [int(line.split()[1]) for line in rest if line.startswith("acked ")]
    return max([acked, *acks]), rest


async def test_sigterm_loses_no_acknowledged_record(ledger_url: str) -> None:
    acked, output = run_appender(ledger_url, signal.SIGTERM, at_least=3000)
    closing = output[-1].split()
    assert closing[0] == "closed", output[-3:]
    appended, written, dropped = int(closing[1]), int(closing[3]), int(closing[5])
    assert appended == acked
    assert (written, dropped) == (appended, 0)

    ledger = open_ledger(ledger_url, read_only=True)  # a new process would see the same
    await ledger.start()
    try:
        rows = await ledger.query(EVERYTHING)
        found = {r.request_id for r in await ledger.latest(None, appended + 100)}
    finally:
        await ledger.aclose()
    assert sum(r.requests for r in rows) == appended
    assert found == {f"req-{n}" for n in range(appended)}


async def test_sigkill_leaves_records_and_totals_consistent(tmp_path: Path) -> None:
    """A crash loses the unwritten tail, never half a batch: raw records and totals agree."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    acked, _ = run_appender(url, signal.SIGKILL, at_least=3000)
    ledger = open_ledger(url)
    await ledger.start()  # the restarted gateway opens the file as usual
    try:
        raw = await ledger.latest(None, acked + 100)
        rows = await ledger.query(EVERYTHING)
    finally:
        await ledger.aclose()
    assert 0 < len(raw) <= acked
    assert sum(r.requests for r in rows) == len(raw)
    assert {r.request_id for r in raw} == {f"req-{n}" for n in range(len(raw))}
