"""Every `tokenweir` command as a shell runs it: Ctrl-C, a reader that closes the pipe, flags
that cannot work. Each ends with its documented status (README, "Exit status") and a line of
explanation, never a traceback."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.ledger import open_ledger
from proxy.policy.units import hash_key
from proxy.tools.mock import backend as mockbackend
from tests.servers import free_port, serve

DEMO = str(Path(__file__).resolve().parent.parent / "policies" / "demo.yaml")
INTERRUPTED = 130
READER_GONE = 141


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "proxy", *args]


@pytest.fixture
def silent() -> Iterator[tuple[str, threading.Event]]:
    """A listener that accepts and never answers, and the event set once it has accepted."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted = threading.Event()
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:
                return
            accepted.set()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}", accepted
    finally:
        listener.close()
        for connection in held:
            connection.close()


def _as_from_a_shell() -> None:
    """The signals a command started from a terminal has: this test process's may differ (a
    signal ignored is ignored in the command too, a blocked one stays blocked across exec)."""
    for sent in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sent, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


class Running:
    """A command started, its stderr read to the end as it comes (so it never blocks on it)."""

    def __init__(self, *args: str, marker: str = "") -> None:
        self.process = subprocess.Popen(
            command(*args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            preexec_fn=_as_from_a_shell,
        )  # fmt: skip
        self.printed = threading.Event()
        """Set once `marker` appears on stderr."""
        self._lines: list[str] = []
        self._reader = threading.Thread(target=self._read, args=(marker,), daemon=True)
        self._reader.start()

    def _read(self, marker: str) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self._lines.append(line)
            if marker and marker in line:
                self.printed.set()

    def interrupt_once(
        self, ready: threading.Event, sent: signal.Signals = signal.SIGINT
    ) -> tuple[int, str]:
        """Ctrl-C (or `sent`) once `ready` is set; the exit status and stderr."""
        try:
            assert ready.wait(timeout=60), "never under way:\n" + "".join(self._lines)
            self.process.send_signal(sent)
            status = self.process.wait(timeout=60)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
        self._reader.join(timeout=10)
        assert self.process.stderr is not None
        self.process.stderr.close()
        return status, "".join(self._lines)


def test_ctrl_c_stops_the_mock_backend_as_it_stops_serve() -> None:
    """It was a KeyboardInterrupt traceback after a clean shutdown."""
    mock = Running("mock-backend", "--port", str(free_port()), marker="Uvicorn running on")
    status, err = mock.interrupt_once(mock.printed)
    assert status == 0, err
    assert "Traceback" not in err
    assert "Application shutdown complete" in err


@pytest.mark.parametrize("which", ["keys", "report"])
def test_ctrl_c_while_waiting_on_a_silent_server_is_130(
    which: str, silent: tuple[str, threading.Event]
) -> None:
    address, accepted = silent
    args = {
        "keys": ["keys", "list", "--base-url", f"http://{address}", "--admin-key", "k"],
        "report": ["report", "--ledger", f"redis://{address}/0"],
    }[which]
    status, err = Running(*args).interrupt_once(accepted)
    assert status == INTERRUPTED, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("sent", "status", "said"),
    [(signal.SIGINT, INTERRUPTED, "interrupted"), (signal.SIGTERM, 143, "terminated")],
)
def test_a_bench_stopped_mid_level_says_so_in_its_status_and_json(
    sent: signal.Signals,
    status: int,
    said: str,
    silent: tuple[str, threading.Event],
    tmp_path: Path,
) -> None:
    """Ctrl-C exited 1 (0 once a level had finished), as a run that had measured everything;
    SIGTERM (`timeout 10m tokenweir bench ...`) killed it, writing nothing."""
    address, accepted = silent
    results = tmp_path / "bench.json"
    bench = Running(
        "bench", "--base-url", f"http://{address}/v1", "--model", "m",
        "--concurrency", "1,2", "--requests", "2", "--json", str(results),
    )  # fmt: skip
    ended, err = bench.interrupt_once(accepted, sent)
    assert ended == status, err
    assert f"{said} (0 of 2 levels done" in err
    assert "Traceback" not in err
    document = orjson.loads(results.read_bytes())
    assert document["interrupted"] is True
    assert document["levels"] == []


@pytest.fixture
def empty_ledger(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"

    async def create() -> None:
        ledger = open_ledger(url)
        await ledger.start()
        await ledger.aclose()

    asyncio.run(create())
    return url


def into_closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    """Run with stdout a pipe whose reader is gone, as `tokenweir report | head -0`."""
    read, write = os.pipe()
    os.close(read)
    env = {**os.environ, "PYTHONUNBUFFERED": ""}  # block-buffered, as in most shells' pipes
    try:
        return subprocess.run(
            command(*args), stdout=write, stderr=subprocess.PIPE, text=True, env=env,
            timeout=120, check=False,
        )  # fmt: skip
    finally:
        os.close(write)


@pytest.mark.parametrize("form", ["table", "csv", "json"])
def test_a_report_into_a_closed_pipe_ends_quietly(empty_ledger: str, form: str) -> None:
    done = into_closed_pipe("report", "--ledger", empty_ledger, "--format", form)
    assert done.returncode == READER_GONE
    assert done.stderr == ""


@pytest.mark.parametrize(
    "args",
    [
        ["policy", "check", "--skip-tokenizers", DEMO],
        ["policy", "hash-key", "k"],
        ["--help"],
        ["--version"],
    ],
)
def test_any_output_into_a_closed_pipe_ends_quietly(args: list[str]) -> None:
    done = into_closed_pipe(*args)
    assert done.returncode == READER_GONE
    assert done.stderr == ""


def test_a_bench_into_a_closed_pipe_still_writes_its_json(backend_url: str, tmp_path: Path) -> None:
    results = tmp_path / "bench.json"
    done = into_closed_pipe(
        "bench", "--base-url", f"{backend_url}/v1", "--model", "mock-llm", "--concurrency", "1",
        "--requests", "2", "--max-tokens", "4", "--json", str(results),
    )  # fmt: skip
    assert done.returncode == READER_GONE, done.stderr
    assert "Traceback" not in done.stderr
    document = orjson.loads(results.read_bytes())
    assert document["interrupted"] is False
    assert document["levels"][0]["ok"] == 2


def _held(app: ASGIApp, opened: threading.Event) -> ASGIApp:
    """`app`, answering HTTP requests only once `opened` is set."""

    async def held(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await asyncio.to_thread(opened.wait, 120)
        await app(scope, receive, send)

    return held


def test_a_bench_whose_status_reader_went_away_runs_on_and_writes_its_json(
    tmp_path: Path,
) -> None:
    """`tokenweir bench ... --json FILE 2>&1 | head -1`: the level's status line met the closed
    pipe, and the BrokenPipeError ended the run there, its JSON never written."""
    opened = threading.Event()
    results = tmp_path / "bench.json"
    with serve(_held(mockbackend.create_app(ttft_ms=0), opened)) as backend:
        read, write = os.pipe()
        process = subprocess.Popen(
            command(
                "bench", "--base-url", f"{backend}/v1", "--model", "mock-llm", "--concurrency",
                "1,2", "--requests", "2", "--max-tokens", "4", "--json", str(results),
            ),
            stdout=write, stderr=write,
        )  # fmt: skip
        os.close(write)
        with os.fdopen(read, "rb") as head:
            first = head.readline()  # `head -1`: one line, then the pipe is closed
        opened.set()  # only now is a level done, and said
        status = process.wait(timeout=120)
    assert first.startswith(b"bench ")
    assert status == READER_GONE
    document = orjson.loads(results.read_bytes())
    assert document["interrupted"] is False
    assert [level["ok"] for level in document["levels"]] == [2, 2]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["serve", "--workers", "0"], "--workers: expected a number of processes, 1 or more"),
        (["serve", "--workers=-2"], "--workers: expected a number of processes, 1 or more"),
        (["serve", "--log-level", "loud"], "--log-level: invalid choice: 'loud'"),
        (["keys"], "give a command: create, list or revoke"),
        (["policy"], "give a command: check or hash-key"),
    ],
)
def test_flags_that_cannot_work_are_a_usage_error(args: list[str], says: str) -> None:
    """`--workers 0` served one process, `--log-level loud` was a ValueError traceback, and
    `keys` alone printed the top command's help on stdout."""
    done = subprocess.run(command(*args), capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert says in done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""


def test_bench_refuses_what_it_could_not_read_or_write_before_sending_anything(
    tmp_path: Path, silent: tuple[str, threading.Event]
) -> None:
    address, accepted = silent
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes("¿qué?\n".encode("latin-1"))
    base = ["bench", "--base-url", f"http://{address}/v1", "--model", "m", "--requests", "1"]
    for extra, says in [
        (["--prompt-file", str(prompts)], "byte 0xbf at offset 0 is not UTF-8"),
        (["--json", str(tmp_path)], f"--json {tmp_path} is a directory"),
        (["--plot", str(tmp_path / "no" / "plot.png")], "there is no directory"),
    ]:
        done = subprocess.run(
            command(*base, *extra), capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 2, done.stderr
        assert says in done.stderr
        assert "Traceback" not in done.stderr
    assert not accepted.is_set()


@pytest.mark.parametrize(
    ("typed", "status", "out", "err"),
    [
        ("sk-abc\n", 0, hash_key("sk-abc") + "\n", ""),
        ("", 1, "", "tokenweir: an empty key cannot be hashed\n"),
    ],
)  # fmt: skip
def test_hash_key_reads_a_key_piped_in_without_a_terminal(
    typed: str, status: int, out: str, err: str
) -> None:
    """`echo $KEY | tokenweir policy hash-key` from a job with no terminal (CI, cron) warned
    that the key might be echoed; with nothing piped in, it was an EOFError traceback."""
    done = subprocess.run(
        command("policy", "hash-key"), input=typed, capture_output=True, text=True,
        timeout=60, check=False, start_new_session=True,
    )  # fmt: skip
    assert (done.returncode, done.stdout, done.stderr) == (status, out, err)


@pytest.mark.parametrize("where", ["a directory", "under a file", "read-only"])
def test_serve_with_a_ledger_it_cannot_open_says_so_in_one_line(where: str, tmp_path: Path) -> None:
    """The app's startup traceback (sqlite3.OperationalError, then LedgerError), status 3."""
    a_file = tmp_path / "file"
    a_file.write_text("")
    ledger = {
        "a directory": tmp_path,
        "under a file": a_file / "ledger.db",
        "read-only": Path("/proc/tokenweir-ledger.db"),  # no one may create a file there
    }[where]
    config = tmp_path / "policy.yaml"
    config.write_text(Path(DEMO).read_text() + f"ledger: sqlite:///{ledger}\n")
    done = subprocess.run(
        command("serve", "--config", str(config), "--port", str(free_port())),
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    said = [line for line in done.stderr.splitlines() if "cannot start" in line]
    assert said == [
        f"{said[0][: said[0].index('tokenweir')]}tokenweir cannot start: cannot open the "
        f"ledger database {ledger}: unable to open database file"
    ]
