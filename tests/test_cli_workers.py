"""`tokenweir serve --workers N`: refused on memory storage (it would multiply every limit); on
Redis, `/metrics` shows the whole server, whichever worker answers, across a worker restart."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from proxy.tools.mock import backend as mockbackend
from tests.redis_server import private_redis
from tests.reliability.state import KEY, policy_text
from tests.servers import free_port, ready_workers, serve, wait_healthy
from tests.test_cli_reload import tokenweir_serve

CHAT: dict[str, Any] = {
    "model": "mock-llm",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 3,
}
_WAIT_S = 60.0  # a limit on a loaded 2-core machine, not a measurement


def test_memory_storage_with_workers_is_refused_with_the_fix(tmp_path: Path) -> None:
    config = tmp_path / "policy.yaml"
    config.write_text(policy_text("http://127.0.0.1:9", "memory"))
    port = free_port()
    command = [sys.executable, "-m", "proxy", "serve", "--config", str(config)]
    done = subprocess.run(
        [*command, "--port", str(port), "--workers", "2"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "--workers 2" in lines[0]
    assert "storage: memory" in lines[0]
    assert "storage: redis://" in lines[0]
    assert "--workers 1" in lines[0]
    assert "Uvicorn running" not in done.stderr  # nothing was started
    with httpx.Client() as http:
        try:
            http.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
            listening = True
        except httpx.TransportError:
            listening = False
    assert not listening


def test_workers_that_fail_to_start_fail_the_command(tmp_path: Path) -> None:
    """uvicorn stops the workers when one fails to start, and its supervisor exited 0: a
    service manager took a gateway that never served for a clean stop."""
    config = tmp_path / "policy.yaml"
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    ledger = f"ledger: sqlite:///{not_a_directory}/ledger.db"  # only a worker opens it
    with private_redis() as redis_url:
        text = policy_text("http://127.0.0.1:9", redis_url)
        config.write_text(text.replace("ledger: redis", ledger))
        command = [sys.executable, "-m", "proxy", "serve", "--config", str(config)]
        done = subprocess.run(
            [*command, "--port", str(free_port()), "--workers", "2"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    assert done.returncode == 3, done.stderr[-2000:]  # uvicorn's STARTUP_FAILURE, as one process
    assert "cannot open the ledger database" in done.stderr
    assert "Traceback" not in done.stderr  # one line from each worker


def test_a_tokenizer_that_cannot_load_is_one_line_before_any_worker(tmp_path: Path) -> None:
    """Every worker printed the app's startup traceback, and the command exited 3, where a
    policy the command can tell is broken exits 1 with one line (as `--workers 1` now does)."""
    config = tmp_path / "policy.yaml"
    missing = tmp_path / "no-such-tokenizer.json"
    port = free_port()
    with private_redis() as redis_url:
        text = policy_text("http://127.0.0.1:9", redis_url)
        config.write_text(text.replace("mock-llm: {}", f'mock-llm: {{tokenizer: "{missing}"}}'))
        command = [sys.executable, "-m", "proxy", "serve", "--config", str(config)]
        done = subprocess.run(
            [*command, "--port", str(port), "--workers", "2"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr[-2000:]
    assert f"{config}: model 'mock-llm': tokenizer '{missing}'" in lines[0]
    assert f"no such file or directory: {missing}" in lines[0]
    assert "a tokenizer is tiktoken:ENCODING" in lines[0]  # the forms that would load
    assert "Started server process" not in done.stderr  # no worker was started


def test_a_sighup_while_the_supervisor_stops_leaves_a_clean_exit(
    backend_url: str, tmp_path: Path
) -> None:
    """SIGTERM, then SIGHUP (`systemctl reload` racing a stop, logrotate): one that reached the
    supervisor as Python exited ended it by SIGHUP's default action, status 129 for a clean
    stop; it is ignored, as one-process `serve` ignores it at shutdown."""
    with private_redis() as redis_url:
        config = tmp_path / "policy.yaml"
        config.write_text(policy_text(backend_url, redis_url))
        with tokenweir_serve(config, "--workers", "2") as (process, _):
            process.terminate()
            began = time.monotonic()
            while process.poll() is None:  # SIGHUPs all the way to the end of the process
                assert time.monotonic() - began < _WAIT_S, "serve did not stop"
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGHUP)
                time.sleep(0.02)
            assert process.returncode == 0


@contextmanager
def _two_workers(backend_url: str, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """`serve --workers 2` on a private Redis; the URL, and where its temporary files go."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    with private_redis() as redis_url:
        config = tmp_path / "policy.yaml"
        config.write_text(policy_text(backend_url, redis_url))
        env = {**os.environ, "TMPDIR": str(temp)}  # the supervisor's metrics directory lands here
        with tokenweir_serve(config, "--workers", "2", env=env) as (_, url):
            # Up once one worker answers: the other may still be starting (a loaded machine).
            _eventually(lambda: _alive_workers_answer(url, killed=-1))
            yield url, temp


def _chat(url: str, count: int) -> None:
    """`count` chats with the openai SDK, every other one streamed, each on a new connection:
    the workers take turns accepting."""
    for i in range(count):
        with openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as sdk:
            if i % 2:
                chunks = list(sdk.chat.completions.create(**CHAT, stream=True))
                assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            else:
                assert sdk.chat.completions.create(**CHAT).choices[0].message.content


_COUNTS = (
    "tokenweir_requests_total",
    "gen_ai_server_request_duration_seconds_count",
    "gen_ai_server_time_to_first_token_seconds_count",  # streams only
)


def _totals(url: str) -> tuple[float, ...]:
    """Requests, request durations and stream TTFTs recorded, summed over labels, from one
    scrape on a new connection (any worker may answer)."""
    with httpx.Client() as fresh:
        text = fresh.get(url + "/metrics").text
    totals = dict.fromkeys(_COUNTS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return tuple(totals.values())


def _ledger_written(url: str) -> float:
    with httpx.Client() as fresh:
        text = fresh.get(url + "/metrics").text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tokenweir_ledger_records_written_total"
    )


def _per_worker(temp: Path) -> dict[int, int]:
    """Requests each worker published (its pid: its file's name), read from the share."""
    (directory,) = temp.glob("tokenweir-metrics-*")
    counts: dict[int, int] = {}
    for path in directory.glob("*.json"):
        series = json.loads(path.read_bytes())["series"]
        counts[int(path.name.partition("-")[0])] = sum(s[1] for s in series)
    return counts


def _eventually(check: Callable[[], bool]) -> None:
    began = time.monotonic()
    while not check():
        assert time.monotonic() - began < _WAIT_S, "not within the wait"
        time.sleep(0.1)


def test_metrics_sum_every_worker_and_survive_restarts(backend_url: str, tmp_path: Path) -> None:
    """Across two worker restarts the totals neither go back nor count twice, and each dead
    worker's file is folded into the one archive: the directory does not grow per restart."""
    with _two_workers(backend_url, tmp_path) as (url, temp):
        _chat(url, 20)
        _eventually(lambda: _totals(url) == (20, 20, 10))
        _eventually(lambda: _ledger_written(url) == 20)  # each worker's ledger, summed too
        answered = _per_worker(temp)
        assert sum(answered.values()) == 20
        assert len(answered) == 2, answered
        assert all(answered.values()), answered  # both workers served some
        for _ in range(10):  # whichever worker answers, the whole server
            assert _totals(url) == (20, 20, 10)
        for total in (30, 40):
            _restart_one_worker(url, temp)
            _chat(url, 10)
            _all_counted(url, total)
        (directory,) = temp.glob("tokenweir-metrics-*")
        names = sorted(path.name for path in directory.iterdir() if path.suffix != ".json")
        kept = ["runtime-keys.kept", "runtime-keys.kept.lock"]
        assert names == [".lock", "accepted-policy.yaml", "dead-workers.archive", *kept]
        assert len(_per_worker(temp)) == 2  # the live workers' files only


def _all_counted(url: str, total: int) -> None:
    """Every request counted, the dead worker's too (never going back), and none twice."""
    seen: list[float] = []

    def counted() -> bool:
        seen.append(_totals(url)[0])
        return seen[-1] == total

    _eventually(counted)
    assert min(seen) >= total - 10  # the dead worker's requests stay counted
    for _ in range(10):
        assert _totals(url) == (total, total, total // 2)  # and are never counted twice


def _restart_one_worker(url: str, temp: Path) -> None:
    """Kill the worker that served the most; the supervisor starts a new one in its place,
    and a scrape folds the dead one's file into the archive."""
    answered = _per_worker(temp)
    killed = max(answered, key=lambda pid: answered[pid])
    os.kill(killed, signal.SIGKILL)
    _eventually(lambda: _alive_workers_answer(url, killed))
    _totals(url)
    assert killed not in _per_worker(temp)


def _alive_workers_answer(url: str, killed: int) -> bool:
    """Two workers answer again, the killed one not among them."""
    pids = set()
    for _ in range(6):
        try:
            with httpx.Client() as fresh:
                pids.add(fresh.get(url + "/readyz?backends=skip").json()["pid"])
        except httpx.TransportError:
            return False
    return killed not in pids and len(pids) == 2


def _hashes(url: str) -> set[str]:
    """The policy versions one scrape (any worker may answer) says serve."""
    with httpx.Client() as fresh:
        text = fresh.get(url + "/metrics").text
    return {
        sample.labels["hash"]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tokenweir_policy_info"
    }


def test_metrics_show_every_policy_version_the_workers_serve(
    backend_url: str, tmp_path: Path
) -> None:
    """One worker reloaded, the other not yet: a scrape showed only the answering worker's
    version, a different one from scrape to scrape. It shows both, whichever worker answers."""
    with _two_workers(backend_url, tmp_path) as (url, _):
        workers: dict[int, str] = {}  # pid: the version it serves, as last seen

        def seen(pid: int | None = None, serving: str = "") -> bool:
            workers.update(ready_workers(url))
            return len(workers) == 2 if pid is None else workers[pid] != serving

        _eventually(seen)
        (old,) = set(workers.values())
        assert _hashes(url) == {old}
        config = tmp_path / "policy.yaml"
        config.write_text(config.read_text() + "# a new version\n")
        first, second = workers
        os.kill(first, signal.SIGHUP)  # this worker alone reloads
        _eventually(lambda: seen(first, old))
        new = workers[first]
        _eventually(lambda: _hashes(url) == {old, new})
        for _ in range(10):
            assert _hashes(url) == {old, new}
        os.kill(second, signal.SIGHUP)
        _eventually(lambda: _hashes(url) == {new})


def test_access_lines_of_two_workers_stay_whole_on_a_slow_stdout(
    backend_url: str, tmp_path: Path
) -> None:
    """Both workers write batches of access lines to one stdout; a reader that falls behind
    (a log shipper) keeps the pipe full, so each batch (here each line: its prompt is logged)
    goes out in pieces: every line must still be whole, not cut by the other worker's bytes."""
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)  # the smallest pipe: every batch fills it
    received = bytearray()

    def read_slowly() -> None:
        with os.fdopen(read_end, "rb") as pipe:
            while chunk := pipe.read1(512):
                received.extend(chunk)
                time.sleep(0.005)

    reader = threading.Thread(target=read_slowly)
    reader.start()
    count = 200
    with private_redis() as redis_url:
        config = tmp_path / "policy.yaml"
        config.write_text(policy_text(backend_url, redis_url) + "log_content: true\n")
        port = free_port()
        command = [sys.executable, "-m", "proxy", "serve", "--config", str(config)]
        with (tmp_path / "serve.log").open("wb") as log:
            process = subprocess.Popen(
                [*command, "--port", str(port), "--workers", "2"], stdout=write_end, stderr=log
            )
        os.close(write_end)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, process)
            with ThreadPoolExecutor(16) as pool:
                statuses = list(pool.map(lambda _: _chat_status(url), range(count)))
        finally:
            process.terminate()
            process.wait(timeout=60)
    reader.join(timeout=_WAIT_S)
    assert statuses == [200] * count
    lines = bytes(received).decode().splitlines()
    broken = [line[:80] for line in lines if not _is_json(line)]
    assert broken == []
    assert sum(json.loads(line)["operation"] == "chat" for line in lines) == count


def _chat_status(url: str) -> int:
    """A chat whose prompt (logged) makes its access line longer than a pipe takes at once."""
    body = {**CHAT, "messages": [{"role": "user", "content": "weir " * 1200}]}
    headers = {"authorization": f"Bearer {KEY}"}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers).status_code


def _is_json(line: str) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def test_a_reload_building_a_slow_tokenizer_keeps_every_worker_and_its_streams(
    tmp_path: Path,
) -> None:
    """A reload adding a tokenizer that takes seconds to build, the GIL held throughout (as a
    large tokenizer.json does): no worker answered the supervisor's health ping for uvicorn's
    5 s, so it killed them all (SIGKILL), their streams were cut, and the workers it started
    again served the old policy. Now they reload in place and every stream ends whole."""
    tokenizer = _slow_tokenizer(tmp_path / "tokenizer.json")
    with serve(mockbackend.create_app(ttft_ms=0, tokens_per_second=50)) as backend:
        with private_redis() as redis_url:
            config = tmp_path / "policy.yaml"
            text = policy_text(backend, redis_url)
            slow = text.replace("mock-llm: {}", f'mock-llm: {{tokenizer: "{tokenizer}"}}')
            config.write_text(text)
            with tokenweir_serve(config, "--workers", "2") as (process, url):
                workers = _both_workers(url)
                flowing = threading.Barrier(5, timeout=_WAIT_S)
                with ThreadPoolExecutor(4) as pool:
                    streams = [pool.submit(_long_stream, url, flowing) for _ in range(4)]
                    flowing.wait()
                    config.write_text(slow)
                    os.kill(process.pid, signal.SIGHUP)
                    ends = [stream.result(timeout=180) for stream in streams]
                assert ends == ["stop"] * 4
                served = _both_workers(url)
                assert set(served) == set(workers)  # the same workers: reloaded in place
                assert set(served.values()) == {_digest(config)}
    assert b"died" not in config.with_suffix(".log").read_bytes()


def _both_workers(url: str) -> dict[int, str]:
    """Each worker's pid and the policy version it serves, once both answered."""
    seen: dict[int, str] = {}

    def both() -> bool:
        seen.update(ready_workers(url))
        return len(seen) == 2

    _eventually(both)
    return seen


def _long_stream(url: str, flowing: threading.Barrier) -> str | None:
    """A 30 s stream (1,500 tokens at 50 a second) through the openai SDK: how it ended."""
    body = {**CHAT, "max_tokens": 1500, "extra_body": {"mock_completion_tokens": 1500}}
    with openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as sdk:
        finish = None
        for i, chunk in enumerate(sdk.chat.completions.create(**body, stream=True)):
            if i == 1:
                flowing.wait()
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        return finish


def _slow_tokenizer(path: Path) -> Path:
    """A tokenizer.json that takes about 10 s to build on 2 cores, all of it holding the GIL:
    each of its 30,000 added tokens goes through its normaliser's 2,000 replacements."""
    replace = [
        {"type": "Replace", "pattern": {"String": f"q{n}q"}, "content": "q"} for n in range(2000)
    ]
    added = [
        {"id": n + 2, "content": f"<tok{n}>", "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": True, "special": False}
        for n in range(30_000)
    ]  # fmt: skip
    path.write_bytes(
        json.dumps({
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": {"type": "Sequence", "normalizers": replace}, "pre_tokenizer": None,
            "post_processor": None, "decoder": None,
            "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "a": 1}, "unk_token": "[UNK]"},
        }).encode()
    )  # fmt: skip
    return path


def _digest(config: Path) -> str:
    return hashlib.sha256(config.read_bytes()).hexdigest()[:16]
