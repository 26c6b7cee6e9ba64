"""`tokenweir` run by a shell with a standard stream closed (`2>&-`, `>&-`, `<&-`): the command
does its work as with /dev/null there. A closed stderr aborted `bench` (SIGABRT: libuv asserts
it never closes fds 0-2, and the closed one had been reused for its own) and failed every
command that said something on stderr; a closed stdout or stdin aborted `bench` too."""

from __future__ import annotations

import asyncio
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from proxy.ledger import open_ledger
from tests.servers import free_port, wait_healthy

DEMO = str(Path(__file__).resolve().parent.parent / "policies" / "demo.yaml")


def in_shell(*args: str, redirect: str) -> subprocess.CompletedProcess[str]:
    """`tokenweir ARGS REDIRECT` as `sh -c` runs it: the stream is closed before the
    interpreter starts, which no `subprocess` argument does (DEVNULL is an open /dev/null)."""
    line = shlex.join([sys.executable, "-m", "proxy", *args]) + " " + redirect
    return subprocess.run(
        ["sh", "-c", line], stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def mock_backend() -> Iterator[str]:
    """A real `tokenweir mock-backend`, itself started with its stderr closed."""
    port = free_port()
    line = f"exec {shlex.join([sys.executable, '-m', 'proxy', 'mock-backend'])}"
    line += f" --port {port} --ttft-ms 0 --tokens-per-second 2000 2>&-"
    process = subprocess.Popen(["sh", "-c", line], stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, path="/v1/models")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def bench(url: str, results: Path) -> list[str]:
    return [
        "bench", "--base-url", f"{url}/v1", "--model", "mock-llm", "--concurrency", "1,2",
        "--requests", "2", "--max-tokens", "4", "--json", str(results),
    ]  # fmt: skip


def test_a_bench_with_stderr_closed_runs_and_prints_its_table(
    mock_backend: str, tmp_path: Path
) -> None:
    results = tmp_path / "bench.json"
    done = in_shell(*bench(mock_backend, results), redirect="2>&-")
    assert done.returncode == 0, (done.returncode, -signal.SIGABRT)
    assert done.stdout.splitlines()[0].startswith("conc  ok/err")
    assert [line.split()[1] for line in done.stdout.splitlines()[1:3]] == ["2/0", "2/0"]
    assert "median stream speed" in done.stdout
    document = orjson.loads(results.read_bytes())
    assert [level["ok"] for level in document["levels"]] == [2, 2]
    assert httpx.get(f"{mock_backend}/v1/models").status_code == 200  # it still serves


@pytest.mark.parametrize("redirect", [">&-", "<&-"])
def test_a_bench_with_stdout_or_stdin_closed_still_writes_its_json(
    mock_backend: str, tmp_path: Path, redirect: str
) -> None:
    results = tmp_path / "bench.json"
    done = in_shell(*bench(mock_backend, results), redirect=redirect)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "concurrency 2: 2 ok, 0 failed" in done.stderr
    document = orjson.loads(results.read_bytes())
    assert [level["ok"] for level in document["levels"]] == [2, 2]


@pytest.mark.parametrize(
    ("args", "printed"),
    [
        (["policy", "check", "--skip-tokenizers", DEMO], "ok"),
        (["policy", "hash-key", "k"], "sha256:"),
        (["--version"], "tokenweir "),
    ],
)
def test_other_commands_with_stderr_closed_print_their_output(
    args: list[str], printed: str
) -> None:
    done = in_shell(*args, redirect="2>&-")
    assert done.returncode == 0
    assert printed in done.stdout


def test_a_report_with_stderr_closed_prints_its_json(tmp_path: Path) -> None:
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"

    async def create() -> None:
        made = open_ledger(ledger)
        await made.start()
        await made.aclose()

    asyncio.run(create())
    done = in_shell("report", "--ledger", ledger, "--format", "json", redirect="2>&-")
    assert done.returncode == 0
    assert orjson.loads(done.stdout)["rows"] == []


@pytest.mark.parametrize(
    "args",
    [
        ["policy", "check", "/nonexistent/policy.yaml"],
        ["policy", "hash-key", ""],
        ["bench", "--base-url", "not a url", "--model", "m"],
    ],
)
def test_an_error_with_stderr_closed_is_not_printed_on_stdout(args: list[str]) -> None:
    """print(..., file=sys.stderr) with no stderr prints on stdout: the error text was taken
    for the command's output (`tokenweir policy hash-key "$K" 2>&- > hashed`)."""
    done = in_shell(*args, redirect="2>&-")
    assert done.returncode != 0
    assert done.stdout == ""
