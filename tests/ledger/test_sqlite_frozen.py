"""A SQLite ledger on a file system frozen under it (fsfreeze: a snapshot, a hung disk or NFS
server): reads give up with an error (/api/usage answers 503) instead of hanging. Root only: it
mounts a small ext4 image of its own on a loop device and freezes that."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.ledger import LedgerError, SqliteLedger
from tests.ledger.factory import record
from tests.ledger.test_sqlite import EVERYTHING

pytestmark = pytest.mark.anyio


@pytest.fixture
def frozen_dir(tmp_path: Path) -> Iterator[tuple[Path, list[str]]]:
    """A mounted file system of its own, and the command that freezes it."""
    if os.geteuid() != 0 or not all(map(shutil.which, ("mkfs.ext4", "fsfreeze", "mount"))):
        pytest.skip("needs root, mkfs.ext4, mount and fsfreeze")
    image, mounted = tmp_path / "fs.img", tmp_path / "mnt"
    image.write_bytes(b"\0" * (16 << 20))
    mounted.mkdir()
    subprocess.run(["mkfs.ext4", "-q", str(image)], check=True)
    if subprocess.run(["mount", "-o", "loop", str(image), str(mounted)]).returncode:
        pytest.skip("cannot mount a loop device here")
    try:
        yield mounted, ["fsfreeze", "-f", str(mounted)]
    finally:
        subprocess.run(["fsfreeze", "-u", str(mounted)], capture_output=True)
        subprocess.run(["umount", "--lazy", str(mounted)], check=False)  # a ledger left open


async def one_record(path: Path, **options: float) -> SqliteLedger:
    """A ledger writing at `path`, one record written."""
    ledger = SqliteLedger(path, **options)  # type: ignore[arg-type]
    await ledger.start()
    ledger.append(record(1))
    await ledger.flush()
    return ledger


async def test_a_read_on_a_frozen_file_system_fails_within_its_timeout(
    frozen_dir: tuple[Path, list[str]],
) -> None:
    mounted, freeze = frozen_dir
    ledger = await one_record(mounted / "ledger.db")
    reader = SqliteLedger(mounted / "ledger.db", read_only=True, read_timeout_s=2.0)
    await reader.start()
    thaw = ["fsfreeze", "-u", str(mounted)]
    await asyncio.to_thread(subprocess.run, freeze, check=True)
    try:
        with pytest.raises(LedgerError, match="no answer from the ledger database"):
            async with asyncio.timeout(30):  # the read the old code waited on for good
                await reader.query(EVERYTHING)
    finally:
        await asyncio.to_thread(subprocess.run, thaw, check=True)
    assert sum(row.requests for row in await reader.query(EVERYTHING)) == 1
    await reader.aclose()
    await ledger.aclose()


async def test_close_on_a_frozen_file_system_returns_and_says_what_is_lost(
    frozen_dir: tuple[Path, list[str]], caplog: pytest.LogCaptureFixture
) -> None:
    """A SIGTERM while frozen: the gateway waited for its writer until the thaw, for good."""
    mounted, freeze = frozen_dir
    ledger = await one_record(mounted / "ledger.db", flush_timeout_s=1.0)
    await asyncio.to_thread(subprocess.run, freeze, check=True)
    try:
        ledger.append(record(2))
        with caplog.at_level(logging.ERROR, "tokenweir.ledger"):
            async with asyncio.timeout(30):  # the close the old code waited on for good
                await ledger.aclose()
    finally:
        await asyncio.to_thread(subprocess.run, ["fsfreeze", "-u", str(mounted)], check=True)
    logged = [r.getMessage() for r in caplog.records]
    assert any("still waiting on" in m for m in logged)
    assert any("ledger closed with 1 records not written (lost)" in m for m in logged)
