"""Does each gateway feature that depends on the HTTP server hold under uvicorn and under granian?

    python benchmarks/server_features.py [--servers uvicorn,granian]

Tries each one for real against a `tokenweir mock-backend` (2,000 tokens/s) and the gateway on
a private Redis with 1 s header and body timeouts, a 2 s keep-alive and a 2 s drain, as
`tokenweir serve` runs it (uvicorn) and as granian would (server_compare.py's launcher, its
header timeout set to the policy's): client disconnect mid-stream and before a non-stream
answer, a silent client, a slowloris, a late body, an idle keep-alive connection, a reader that
stops reading (backpressure), SIGTERM drain, and with two workers: /metrics summed over the
workers and SIGHUP reloading the policy without cutting a stream. Prints one line per check and
server, and writes benchmarks/results/server-features.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
from harness import Process, publish, started, table
from server_compare import granian_started

from proxy.telemetry.workershare import METRICS_DIR_ENV
from tests.redis_server import private_redis
from tests.reliability.state import AUTH, KEY, ledger_records, policy_text, slots_held
from tests.servers import ready_workers

# keep_alive_timeout differs from header_timeout, to see which one closes an idle connection.
SERVER = "{header_timeout: 1s, body_timeout: 1s, keep_alive_timeout: 2s, drain_timeout: 2s}"
GRANIAN_TIMEOUTS = ("--http1-header-read-timeout", "1000", "--workers-kill-timeout", "7")
CHAT = {"model": "mock-llm", "messages": [{"role": "user", "content": "Tell a long story."}]}
LONG = {**CHAT, "max_tokens": 20_000, "mock_completion_tokens": 20_000}  # 10 s at 2,000 tok/s
SHORT = {**CHAT, "stream": True, "mock_completion_tokens": 1_500}  # 0.75 s

Result = dict[str, Any]


def launch(
    server: str, config: Path, log: Path, workers: int = 1, env: dict[str, str] | None = None
) -> contextlib.AbstractContextManager[Process]:
    if server == "uvicorn":
        return started(
            ["serve", "--config", str(config), "--workers", str(workers)], "/healthz", log
        )
    extra = (*GRANIAN_TIMEOUTS, "--workers", str(workers))
    return granian_started(config, log, extra=extra, env=env)


def _stats(mock: str) -> dict[str, int]:
    found: dict[str, int] = httpx.get(mock + "/mock/stats").json()
    return found


def _until(check: Callable[[], bool], within_s: float) -> float | None:
    """Seconds until `check()` held, or None if it did not within `within_s`."""
    began = time.monotonic()
    while time.monotonic() - began < within_s:
        if check():
            return time.monotonic() - began
        time.sleep(0.005)
    return None


def disconnect_stream(url: str, mock: str) -> Result:
    httpx.post(mock + "/mock/stats/reset")
    with (
        httpx.Client(base_url=url, timeout=10) as http,
        http.stream(
            "POST", "/v1/chat/completions", json={**LONG, "stream": True}, headers=AUTH
        ) as answer,
    ):
        lines = answer.iter_lines()
        for _ in range(20):
            next(lines)
        answer.close()
        took = _until(lambda: _stats(mock)["streams_cancelled"] >= 1, 5)
    ok = took is not None and took < 0.5
    return {"ok": ok, "detail": _seconds("backend stream cancelled", took)}


def disconnect_non_stream(url: str, mock: str) -> Result:
    httpx.post(mock + "/mock/stats/reset")
    with contextlib.suppress(httpx.ReadTimeout):
        httpx.post(url + "/v1/chat/completions", json=LONG, headers=AUTH, timeout=0.3)
    took = _until(lambda: _stats(mock)["requests_cancelled"] >= 1, 5)
    return {
        "ok": took is not None and took < 0.5,
        "detail": _seconds("backend request cancelled after the client's 0.3 s", took),
    }


def _seconds(what: str, took: float | None) -> str:
    return f"{what} in {took * 1000:.0f} ms" if took is not None else f"{what}: not within 5 s"


def _read_until_closed(sock: socket.socket, within_s: float) -> tuple[bytes, float | None]:
    """What arrives until the server closes; seconds until its first byte or the close."""
    began, received, answered = time.monotonic(), b"", None
    sock.settimeout(within_s)
    try:
        while chunk := sock.recv(65536):
            answered = answered or time.monotonic() - began
            received += chunk
    except TimeoutError:
        return received, answered
    except ConnectionResetError:
        pass
    return received, answered or time.monotonic() - began


def silent_client(url: str, mock: str) -> Result:
    with socket.create_connection(_address(url)) as sock:
        received, took = _read_until_closed(sock, 5)
    return _timeout_result("nothing sent", received, took)


def slowloris(url: str, mock: str) -> Result:
    with socket.create_connection(_address(url)) as sock:
        began = time.monotonic()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        received, took = b"", None
        for i in range(50):  # a header every 0.1 s for up to 5 s
            try:
                sock.sendall(b"x-slow-%d: 1\r\n" % i)
                time.sleep(0.1)
                sock.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    chunk = sock.recv(65536)
                    received += chunk
                    if not chunk:
                        break
                sock.setblocking(True)
            except (BrokenPipeError, ConnectionResetError):
                break
        if time.monotonic() - began < 4.9:
            took = time.monotonic() - began
    return _timeout_result("a header every 0.1 s", received, took)


def late_body(url: str, mock: str) -> Result:
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {KEY}\r\ncontent-length: 1000\r\n\r\n"
    )
    with socket.create_connection(_address(url)) as sock:
        sock.sendall(head.encode() + b'{"model": ')
        received, took = _read_until_closed(sock, 5)
    return _timeout_result("1,000-byte body, 10 bytes sent", received, took)


def _timeout_result(what: str, received: bytes, took: float | None) -> Result:
    status = received.split(b"\r\n", 1)[0].decode("latin-1") if received else "nothing"
    shaped = b'"request_timeout"' in received
    ok = took is not None and took < 2.5 and status.startswith("HTTP/1.1 408") and shaped
    when = f"{took:.2f} s" if took is not None else "not cut within 5 s"
    return {
        "ok": ok,
        "detail": f"{what}: {when}, answer: {status}" + (" (OpenAI-shaped)" if shaped else ""),
    }


def idle_keep_alive(url: str, mock: str) -> Result:
    with socket.create_connection(_address(url)) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        sock.settimeout(5)
        first = b""
        while not first.endswith(b'{"status":"ok"}'):  # the whole answer, however it comes
            first += sock.recv(65536)
        began = time.monotonic()
        sock.settimeout(10)
        try:
            rest = sock.recv(65536)
            took: float | None = time.monotonic() - began if rest == b"" else None
        except TimeoutError:
            took = None
    ok = first.startswith(b"HTTP/1.1 200") and took is not None and 1.8 <= took < 3
    when = f"closed after {took:.2f} s" if took is not None else "still open after 10 s"
    return {"ok": ok, "detail": f"keep_alive_timeout 2 s, header_timeout 1 s: {when}"}


def stalled_reader(server: str, mock: str, redis_url: str, work: Path) -> Result:
    """A client that stops reading: the gateway should stop reading the backend (TCP
    backpressure), not buffer the answer. `mock` is unpaced: it sends as fast as it may."""
    config = work / f"stalled-{server}.yaml"
    text = policy_text(mock, redis_url, server=SERVER)
    config.write_text(text.replace("max_output_tokens: 30000", "max_output_tokens: 2000000"))
    body = orjson.dumps({**CHAT, "stream": True, "mock_completion_tokens": 1_000_000})
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {KEY}\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    with launch(server, config, work / f"stalled-{server}.log") as gateway:
        rss_before = gateway.memory_mb()["rss_mb"]
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
            sock.connect(_address(gateway.url))
            sock.sendall(head.encode() + body)
            time.sleep(3)  # the backend makes its answer (1-2 s), the buffers on the way fill
            rss_3s = gateway.memory_mb()["rss_mb"]
            time.sleep(6)
            rss_9s = gateway.memory_mb()["rss_mb"]
    # Without backpressure the gateway would hold what the backend sends on, ~10 MB/s (the
    # ~50k tokens/s this backend streams to a reading client): 60 MB in those 6 s, not a few.
    return {
        "ok": rss_9s - rss_3s < 20,
        "detail": f"unpaced 1,000,000-token stream, client reading nothing: gateway RSS "
        f"{rss_before:.0f} MB before, {rss_3s:.0f} MB after 3 s, {rss_9s:.0f} MB after 9 s",
    }


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def _stream_lines(
    url: str, body: dict[str, object], lines: list[str], started_: asyncio.Event
) -> None:
    async with (
        httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as answer,
    ):
        with contextlib.suppress(httpx.TransportError):
            async for line in answer.aiter_lines():
                if line:
                    lines.append(line)
                    started_.set()


async def _signal_mid_streams(
    process: Process, signum: int, bodies: list[dict[str, object]]
) -> tuple[list[list[str]], float]:
    """Open a stream per body, send `signum` to the server once all have begun, wait for all."""
    outputs: list[list[str]] = [[] for _ in bodies]
    events = [asyncio.Event() for _ in bodies]
    tasks = [
        asyncio.create_task(_stream_lines(process.url, body, out, event))
        for body, out, event in zip(bodies, outputs, events, strict=True)
    ]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 10)
    process.popen.send_signal(signum)
    began = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    return outputs, time.monotonic() - began


def _ending(lines: list[str]) -> str:
    if not lines:
        return "nothing"
    if lines[-1] == "data: [DONE]":
        return "[DONE]"
    with contextlib.suppress(orjson.JSONDecodeError, KeyError, TypeError):
        return str(orjson.loads(lines[-1].removeprefix("data: "))["error"]["code"])
    return "cut mid-stream"


def drain(server: str, mock: str, redis_url: str, work: Path) -> Result:
    config = work / f"drain-{server}.yaml"
    config.write_text(policy_text(mock, redis_url, server=SERVER))
    records = ledger_records(redis_url)
    with launch(server, config, work / f"drain-{server}.log") as gateway:
        bodies: list[dict[str, object]] = [SHORT, {**LONG, "stream": True}]
        (short, long), took = asyncio.run(_signal_mid_streams(gateway, signal.SIGTERM, bodies))
        exited = _until(lambda: gateway.popen.poll() is not None, 15)
    endings = (_ending(short), _ending(long))
    billed = ledger_records(redis_url) - records
    ok = (
        endings == ("[DONE]", "server_shutting_down")
        and 1.8 <= took < 5
        and exited is not None
        and slots_held(redis_url) == 0
        and billed == 2
    )
    return {
        "ok": ok,
        "detail": f"short stream: {endings[0]}, long: {endings[1]} after "
        f"{took:.1f} s (drain 2 s); exited: {exited is not None}; billed {billed} of 2, "
        f"slots held {slots_held(redis_url)}",
    }


def two_workers(server: str, mock: str, redis_url: str, work: Path) -> list[tuple[str, Result]]:
    """/metrics summed over two workers; SIGHUP reloads both, an open stream goes on."""
    config = work / f"workers-{server}.yaml"
    config.write_text(policy_text(mock, redis_url, server=SERVER))
    metrics_dir = tempfile.mkdtemp(prefix="tokenweir-metrics-")
    env = {METRICS_DIR_ENV: metrics_dir}  # `tokenweir serve --workers` sets this itself
    with launch(server, config, work / f"workers-{server}.log", 2, env) as gateway:
        for _ in range(20):
            with httpx.Client() as fresh:  # a new connection each: any worker may answer
                fresh.post(
                    gateway.url + "/v1/chat/completions",
                    json={**CHAT, "max_tokens": 4},
                    headers=AUTH,
                ).raise_for_status()
        before = ready_workers(gateway.url)
        counted = _until(lambda: _requests_total(gateway.url) == 20, 8)
        metrics = {
            "ok": counted is not None and len(before) == 2,
            "detail": f"{len(before)} workers answered; /metrics shows 20 of 20 requests: "
            f"{counted is not None}",
        }
        config.write_text(policy_text(mock, redis_url, server=SERVER, max_concurrent=63))
        # 12 s: past granian's respawn of both workers (3.5 s apart) and the old ones' drain.
        body: dict[str, object] = {**LONG, "stream": True, "mock_completion_tokens": 24_000,
                                   "max_tokens": 24_000}  # fmt: skip
        [lines], _ = asyncio.run(_signal_mid_streams(gateway, signal.SIGHUP, [body]))
        after = ready_workers(gateway.url)
    hashes = set(after.values())
    reloaded = len(hashes) == 1 and not hashes & set(before.values())
    kept = set(after) == set(before)
    ending = _ending(lines)
    sighup = {
        "ok": reloaded and ending == "[DONE]",
        "detail": f"policy reloaded in every worker: {reloaded}; workers "
        f"{'kept' if kept else 'replaced'}; the 12 s stream open during SIGHUP ended: "
        f"{ending}",
    }
    return [
        ("--workers 2: /metrics is the whole server", metrics),
        ("--workers 2: SIGHUP reloads, streams go on", sighup),
    ]


def _requests_total(url: str) -> float:
    with httpx.Client() as fresh:
        text = fresh.get(url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("tokenweir_requests_total{")
    )


CHECKS: tuple[tuple[str, Callable[[str, str], Result]], ...] = (
    ("client disconnect mid-stream stops the backend", disconnect_stream),
    ("client disconnect before a non-stream answer", disconnect_non_stream),
    ("silent client: 408 at header_timeout", silent_client),
    ("slowloris: 408 at header_timeout", slowloris),
    ("late body: 408 at body_timeout", late_body),
    ("idle keep-alive closed at keep_alive_timeout", idle_keep_alive),
)


@contextlib.contextmanager
def _watchdog(seconds: float) -> Iterator[None]:
    """A check that hangs fails the script rather than blocking it forever."""
    timer = threading.Timer(seconds, lambda: os._exit(3))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def run(servers: list[str], only: str, work: Path) -> dict[str, dict[str, Result]]:
    """Every check whose name contains `only`, on each server."""
    results: dict[str, dict[str, Result]] = {}
    with (
        private_redis() as redis_url,
        started(["mock-backend", "--tokens-per-second", "2000"], "/v1/models",
                work / "mock.log") as mock,
        started(["mock-backend", "--tokens-per-second", "inf"], "/v1/models",
                work / "unpaced.log") as unpaced,
    ):  # fmt: skip
        for server in servers:
            found = results.setdefault(server, {})
            record = functools.partial(_record, found, server)
            config = work / f"{server}.yaml"
            config.write_text(policy_text(mock.url, redis_url, server=SERVER))
            with launch(server, config, work / f"{server}.log") as gateway:
                for name, check in CHECKS:
                    if only in name:
                        with _watchdog(60):
                            record(name, check(gateway.url, mock.url))
            if only in STALLED:
                with _watchdog(60):
                    record(STALLED, stalled_reader(server, unpaced.url, redis_url, work))
            if only in DRAIN:
                with _watchdog(60):
                    record(DRAIN, drain(server, mock.url, redis_url, work))
            if only in "--workers 2":
                with _watchdog(120):
                    for name, result in two_workers(server, mock.url, redis_url, work):
                        record(name, result)
    return results


def _record(found: dict[str, Result], server: str, name: str, result: Result) -> None:
    found[name] = result
    print(f"{server:8} {name}: {result}", flush=True)


STALLED = "a client that stops reading pushes back"
DRAIN = "SIGTERM drains, then settles and exits"


def markdown(results: dict[str, dict[str, Result]]) -> str:
    servers = list(results)
    columns = (("feature", None, 0), *((server, None, 0) for server in servers))
    names = list(next(iter(results.values())))
    rows = [
        [
            name,
            *(
                ("yes: " if results[s][name]["ok"] else "**no**: ") + results[s][name]["detail"]
                for s in servers
            ),
        ]
        for name in names
    ]
    return "\n".join(table(columns, rows)) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="uvicorn,granian")
    parser.add_argument("--only", default="", help="the checks whose names contain this")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = run(args.servers.split(","), args.only, Path(tmp))
    if args.only:
        print(markdown(results))
    else:
        publish("server-features", {"results": results}, markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
