"""`tokenweir demo` as a user stops it: its temporary folder goes whichever way it ends."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

import pytest


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_the_demo_removes_its_temporary_folder_when_stopped(stop: signal.Signals) -> None:
    # faulthandler: a demo that hangs is sent SIGABRT below and prints every thread's stack.
    command = [sys.executable, "-X", "faulthandler", "-m", "proxy", "demo", "--port", "0"]
    demo = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert demo.stdout is not None
    assert demo.stderr is not None
    # Both pipes are read to the end, so the demo never blocks on a full one.
    errors: list[str] = []
    reader = _drain(demo.stderr, errors)
    try:
        printed = []
        for line in demo.stdout:
            printed.append(line)
            if line.startswith("Serving until Ctrl-C"):
                break
        found = re.search(r"--ledger sqlite:///(\S+)", "".join(printed))
        assert found, "".join(printed) + "".join(errors)
        folder = Path(found[1]).parent
        assert folder.is_dir()
        _drain(demo.stdout, printed)
        demo.send_signal(stop)
        try:
            status = demo.wait(timeout=60)
        except subprocess.TimeoutExpired:
            demo.send_signal(signal.SIGABRT)
            demo.wait(timeout=30)
            reader.join(timeout=10)
            pytest.fail(f"the demo did not stop within 60 s of {stop.name}:\n{''.join(errors)}")
        reader.join(timeout=10)
        assert status == 0, "".join(errors)
        assert not folder.exists()
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        demo.stdout.close()
        demo.stderr.close()


def _drain(pipe: IO[str], lines: list[str]) -> threading.Thread:
    thread = threading.Thread(target=lambda: lines.extend(pipe), daemon=True)
    thread.start()
    return thread


def test_a_port_in_use_is_one_line_and_status_3() -> None:
    """It was an OSError traceback, once the simulated backend was already running."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "proxy", "demo", "--port", str(port), "--exit"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 3, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in done.stderr
    assert "Traceback" not in done.stderr
