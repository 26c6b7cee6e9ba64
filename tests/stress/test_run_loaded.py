"""tests/stress/run_loaded.sh: pytest's exit status comes back, and no CPU hog outlives it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).with_name("run_loaded.sh")
ENV = {**os.environ, "TOKENWEIR_HOGS": "2", "PYTHON": sys.executable}


def _hogs(stderr: str) -> list[int]:
    found = re.search(r"pids ([\d ]+)\)", stderr)
    assert found, stderr
    return [int(pid) for pid in found.group(1).split()]


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's reaper may be slow or absent in a container)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_pytests_status_comes_back_and_the_hogs_are_gone(tmp_path: Path) -> None:
    (tmp_path / "test_probe.py").write_text("def test_ok():\n    pass\n\ndef test_no():\n    1/0\n")
    command = [str(SCRIPT), "-q", "-p", "no:cacheprovider"]
    done = subprocess.run(
        command, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 1, done.stdout + done.stderr  # one failure: pytest's status 1
    assert "1 failed, 1 passed" in done.stdout
    hogs = _hogs(done.stderr)
    assert len(hogs) == 2
    assert not any(map(_running, hogs))


def test_hogs_stop_even_when_the_script_is_killed_outright(tmp_path: Path) -> None:
    pid_file = tmp_path / "pytest.pid"
    (tmp_path / "test_probe.py").write_text(
        f"import os, time\n\ndef test_wait():\n"
        f"    open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n    time.sleep(120)\n"
    )
    command = [str(SCRIPT), "-q", "-p", "no:cacheprovider", "-s"]
    with subprocess.Popen(command, cwd=tmp_path, env=ENV, stderr=subprocess.PIPE, text=True) as run:
        assert run.stderr is not None
        hogs = _hogs(run.stderr.readline())
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the inner pytest never started"
            time.sleep(0.05)
        run.kill()  # SIGKILL: no trap runs
        run.wait()
        os.kill(int(pid_file.read_text()), signal.SIGTERM)  # the orphaned inner pytest
        deadline = time.monotonic() + 30
        while any(map(_running, hogs)):
            assert time.monotonic() < deadline, "a CPU hog outlived the script"
            time.sleep(0.05)
