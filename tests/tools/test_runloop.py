"""A command's event loop (proxy/tools/runloop.py): Ctrl-C stops the command even where its
first cancel is swallowed, as Python 3.11's `asyncio.wait_for` swallows one that arrives as the
connection it waits on opens (`tokenweir report` ran on to its 5 s read timeout and exited 1)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from proxy.tools import runloop

SWALLOWS_ONE_CANCEL = textwrap.dedent(
    """
    import asyncio, sys
    from proxy.tools import runloop

    async def command():
        try:
            print("ready", flush=True)
            await asyncio.sleep(120)
        except asyncio.CancelledError:
            print("first cancel swallowed", flush=True)
        try:
            await asyncio.sleep(120)  # as the read that a swallowed cancel runs on into
        finally:
            print("stopped by the second", flush=True)

    try:
        runloop.run(command())
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
    print("ran to its end", flush=True)
    """
)


def test_ctrl_c_stops_a_command_whose_first_cancel_is_swallowed() -> None:
    """With `asyncio.run` this ran for the whole two minutes and exited 0."""
    with subprocess.Popen(
        [sys.executable, "-c", SWALLOWS_ONE_CANCEL], stdout=subprocess.PIPE, text=True
    ) as process:
        try:
            assert process.stdout is not None
            assert process.stdout.readline() == "ready\n"
            process.send_signal(signal.SIGINT)
            status = process.wait(timeout=60)  # the second cancel comes a second after the first
            said = process.stdout.read().split("\n")
        finally:
            if process.poll() is None:
                process.kill()
    assert status == 130
    assert said[:3] == ["first cancel swallowed", "stopped by the second", "interrupted"]


def test_a_command_that_ends_gives_its_result_or_its_error() -> None:
    async def answer() -> int:
        return 42

    async def fails() -> None:
        raise LookupError("no such ledger")

    assert runloop.run(answer()) == 42
    with pytest.raises(LookupError, match="no such ledger"):
        runloop.run(fails())
