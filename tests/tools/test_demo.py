"""`tokenweir demo` as a user stops it: its temporary folder goes whichever way it ends."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_the_demo_removes_its_temporary_folder_when_stopped(stop: signal.Signals) -> None:
    command = [sys.executable, "-m", "proxy", "demo", "--port", "0"]
    demo = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert demo.stdout is not None
        printed = []
        for line in demo.stdout:
            printed.append(line)
            if line.startswith("Serving until Ctrl-C"):
                break
        found = re.search(r"--ledger sqlite:///(\S+)", "".join(printed))
        assert found, "".join(printed)
        folder = Path(found[1]).parent
        assert folder.is_dir()
        demo.send_signal(stop)
        assert demo.wait(timeout=60) == 0
        assert not folder.exists()
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        for stream in (demo.stdout, demo.stderr):
            if stream is not None:
                stream.close()
