"""The benchmark suite's plumbing: start tokenweir processes, drive `tokenweir bench`, tabulate."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from proxy.policy.units import hash_key

# Benchmarks run from a checkout; they may use the tests' helpers (e.g. a private Redis).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).parent / "results"
KEY = "bench-key"
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def publish(name: str, report: dict[str, Any], text: str) -> None:
    """results/NAME.json (the report) and results/NAME.md (its table, which run.py puts into
    docs/benchmarks.md), and the table on stdout."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(text, encoding="utf-8")
    print(text)


def stat_fields(stat: Path) -> list[str]:
    """A /proc/PID/stat (or /proc/PID/task/TID/stat) file's fields after the command's name,
    which may hold spaces and parentheses: index 11 is utime, 12 stime, 13 and 14 the reaped
    children's."""
    return stat.read_text().rsplit(")", 1)[1].split()


def machine_idle_s() -> float:
    """Seconds the machine's cores have spent idle or waiting on I/O since boot, summed."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return (int(fields[4]) + int(fields[5])) / TICKS_PER_S


def cpu_ticks(stat: Path) -> int:
    """utime + stime of a process or thread, in clock ticks (TICKS_PER_S a second)."""
    fields = stat_fields(stat)
    return int(fields[11]) + int(fields[12])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Process:
    popen: subprocess.Popen[bytes]
    url: str

    def cpu_s(self) -> float:
        """CPU seconds of the process and every process under it (`serve --workers N`)."""
        return sum(self.cpu_s_by_process().values())

    def cpu_s_by_process(self) -> dict[int, float]:
        """CPU seconds so far of each process of the tree (the supervisor and its workers)."""
        found: dict[int, float] = {}
        for pid in self._tree():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                found[pid] = cpu_ticks(Path(f"/proc/{pid}/stat")) / TICKS_PER_S
        return found

    def memory_mb(self) -> dict[str, float]:
        """RSS and peak RSS, summed over the process tree."""
        rss = peak = 0
        for pid in self._tree():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                status = Path(f"/proc/{pid}/status").read_text().splitlines()
                values = {
                    line.split(":")[0]: line.split()[1] for line in status if line.startswith("Vm")
                }
                rss += int(values["VmRSS"])
                peak += int(values["VmHWM"])
        return {"rss_mb": rss / 1024, "peak_rss_mb": peak / 1024}

    def _tree(self) -> list[int]:
        pids, i = [self.popen.pid], 0
        while i < len(pids):
            for task in Path(f"/proc/{pids[i]}/task").glob("*/children"):
                with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                    pids.extend(int(child) for child in task.read_text().split())
            i += 1
        return pids


@contextmanager
def started(args: list[str], probe: str, log: Path) -> Iterator[Process]:
    port = free_port()
    command = [sys.executable, "-m", "proxy", *args, "--port", str(port)]
    with running(command, port, probe, log, " ".join(args)) as process:
        yield process


@contextmanager
def running(
    command: list[str],
    port: int,
    probe: str,
    log: Path,
    name: str,
    cwd: Path | None = None,
    *,
    within_s: float = 30.0,
) -> Iterator[Process]:
    """`command` (output to `log`), once it answers `probe` on `port` (waiting `within_s` for
    it to start, and as long for it to stop); stopped at the end."""
    with log.open("wb") as out:
        popen = subprocess.Popen(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:  # one that never answers is stopped too
        wait_answering(url + probe, popen, f"{name} did not start; see {log}", within_s)
        yield Process(popen, url)
    finally:
        popen.terminate()
        popen.wait(timeout=within_s)


def wait_answering(
    url: str, popen: subprocess.Popen[bytes], failure: str, within_s: float = 30.0
) -> None:
    """Wait up to `within_s` until `url` answers 2xx to the bench key; raise `failure` if
    `popen` exits first or it never does."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            if httpx.get(url, headers={"authorization": f"Bearer {KEY}"}).is_success:
                return
        except httpx.TransportError:
            pass
        if popen.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(failure)
        time.sleep(0.1)


def policy_for(
    backend_url: str,
    directory: Path,
    *,
    name: str = "plain",
    tokenizer: str | None = None,
    budget: str = "{}",
    limits: str = "{}",
    storage: str = "memory",
    ledger: str | None = None,
    cache: str = "{}",
) -> Path:
    """A one-tenant policy (key KEY) on `backend_url`; optionally tokenizer, budget, limits."""
    path = directory / f"policy-{name}-{backend_url.rsplit(':', 1)[1]}.yaml"
    counting = f", tokenizer: {json.dumps(tokenizer)}" if tokenizer else ""
    path.write_text(
        f"""
storage: {storage}
{f"ledger: {ledger}" if ledger else ""}
backends:
  - {{name: mock, url: "{backend_url}/v1", models: [mock-llm]}}
models:
  mock-llm: {{price: {{input_per_1m: 0.1, output_per_1m: 0.4}}{counting}}}
tenants:
  bench: {{api_keys: [{hash_key(KEY)}], models: [mock-llm], budget: {budget}, limits: {limits},
          cache: {cache}}}
"""
    )
    return path


def bench_command(
    base_url: str,
    concurrency: int,
    requests: int,
    *,
    stream: bool,
    tokens: int,
    out: str,
    input_tokens: int = 64,
    prompt_file: Path | None = None,
) -> list[str]:
    # A fresh prompt seed per run: a gateway with the response cache must not answer a later
    # run's prompts from an earlier run's (the overhead measured is the lookup, not the hit).
    seed = secrets.randbelow(1 << 30)
    prompts = ["--prompt-file", str(prompt_file)] if prompt_file is not None else []
    return [
        sys.executable, "-m", "proxy", "bench", "--base-url", base_url + "/v1",
        "--api-key", KEY, "--model", "mock-llm", "--concurrency", str(concurrency),
        "--requests", str(requests), "--max-tokens", str(tokens),
        "--input-tokens", str(input_tokens),
        "--stream" if stream else "--no-stream", "--json", out,
        "--extra-body", json.dumps({"mock_completion_tokens": tokens}), "--seed", str(seed),
        *prompts,
    ]  # fmt: skip


def bench(
    base_url: str,
    concurrency: int,
    requests: int,
    *,
    stream: bool,
    tokens: int,
    input_tokens: int = 64,
    prompt_file: Path | None = None,
) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = bench_command(
            base_url, concurrency, requests, stream=stream, tokens=tokens, out=out.name,
            input_tokens=input_tokens, prompt_file=prompt_file,
        )  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"bench failed: {done.stderr[-2000:]}")
        level: dict[str, Any] = json.loads(Path(out.name).read_text())["levels"][0]
        return level


@dataclass
class Samples:
    values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, value: float | None) -> None:
        if value is not None:
            self.values.setdefault(name, []).append(value)

    def median(self, name: str) -> float | None:
        found = self.values.get(name)
        return statistics.median(found) if found else None


def warm_up(*targets: Process) -> None:
    """One small request per target first: imports, connections and caches warm, as in service."""
    for target in targets:
        bench(target.url, 4, 8, stream=True, tokens=8)


def cell(value: float | None, digits: int) -> str:
    """Negative `digits`: seconds shown as milliseconds with that many decimals."""
    if value is None:
        return "n/a"
    if digits < 0:
        return f"{value * 1000:.{-digits}f}"
    return f"{value:,.{digits}f}"


def table(columns: tuple[tuple[str, str | None, int], ...], rows: list[list[str]]) -> list[str]:
    head = "| " + " | ".join(title for title, _, _ in columns) + " |"
    rule = "|" + "|".join("---:" for _ in columns) + "|"
    return [head, rule, *("| " + " | ".join(row) + " |" for row in rows)]


@contextmanager
def redis_for(url: str | None) -> Iterator[str]:
    """The Redis at `url` if one is given, else a private redis-server for this run."""
    if url:
        yield url
        return
    # Imported here: the repo root joins sys.path only after this module's own imports.
    from tests.redis_server import private_redis

    with private_redis() as private:
        yield private


@contextmanager
def otel_environment(variables: dict[str, str]) -> Iterator[None]:
    """This process's environment (which a `tokenweir serve` it starts inherits) with
    `variables` as the only OTEL_* and TOKENWEIR_TRACE_PATH settings."""
    saved = dict(os.environ)
    for name in [n for n in os.environ if n.startswith("OTEL_") or n == "TOKENWEIR_TRACE_PATH"]:
        del os.environ[name]
    os.environ.update(variables)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
