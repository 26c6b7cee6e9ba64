"""`tokenweir demo`: a simulated backend, the gateway on demo.yaml, a simulated day in its ledger
and live traffic from two tenants; the dashboard URL to look at it all."""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from proxy.app import DEFAULT_POLICY, create_app
from proxy.exitstatus import CANNOT_SERVE
from proxy.ledger import LedgerError, open_ledger
from proxy.ledger.present import iso_utc
from proxy.policy import load_policy
from proxy.tools import demotraffic, report, runloop
from proxy.tools.background import BackgroundServer
from proxy.tools.mock import backend as mockbackend

__all__ = ["DEMO_ADMIN_KEY", "DEMO_KEYS", "DEMO_POLICY", "run_demo"]

DEMO_POLICY = "demo.yaml"
DEMO_KEYS = {
    "support-bot": "tw-demo-support",
    "research": "tw-demo-research",
    "翻译助手": "tw-demo-translate",
}
DEMO_ADMIN_KEY = "tw-demo-admin"


@dataclass(frozen=True, slots=True)
class _Call:
    tenant: str
    what: str
    path: str
    body: dict[str, Any]


_CALLS = (
    _Call("support-bot", "chat, streamed", "/v1/chat/completions", {
        "model": "mock-llm-small", "stream": True, "max_tokens": 48,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "我的订单什么时候发货？"}],
    }),
    _Call("support-bot", "chat", "/v1/chat/completions", {
        "model": "mock-llm-small", "max_tokens": 32,
        "messages": [{"role": "user", "content": "How do I reset my password?"}],
    }),
    _Call("support-bot", "embeddings", "/v1/embeddings", {
        "model": "mock-embed", "input": ["refund policy", "shipping times"],
    }),
    _Call("support-bot", "a model it may not use", "/v1/chat/completions", {
        "model": "mock-llm", "messages": [{"role": "user", "content": "hi"}],
    }),
    _Call("research", "chat, streamed", "/v1/chat/completions", {
        "model": "mock-llm", "stream": True, "max_tokens": 200,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Summarise the history of the transistor."}],
    }),
    _Call("research", "text completion", "/v1/completions", {
        "model": "mock-llm", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
    }),
    _Call("research", "the same, again", "/v1/completions", {
        "model": "mock-llm", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
    }),
)  # fmt: skip


def run_demo(*, port: int = 8080, keep_serving: bool = True) -> int:
    """Start everything, send the demo traffic, print what happened; serve on until Ctrl-C."""
    backend = BackgroundServer(mockbackend.create_app(ttft_ms=120, tokens_per_second=150))
    backend_url = backend.start()
    workdir = tempfile.TemporaryDirectory(prefix="tokenweir-demo-")
    ledger_path = Path(workdir.name) / "ledger.db"
    ledger = f"sqlite:///{ledger_path}"
    policy = load_policy(DEFAULT_POLICY.with_name(DEMO_POLICY), environ={})
    backends = tuple(b.model_copy(update={"url": backend_url + "/v1"}) for b in policy.backends)
    demo_policy = policy.model_copy(update={"backends": backends, "ledger": ledger})
    live_start = time.time()
    # The simulated day ends where this hour begins, so the live traffic's report stands apart.
    day = demotraffic.simulated_day(demo_policy, live_start - live_start % 3600)
    demotraffic.fill_ledger(ledger_path, day)
    try:
        gateway = BackgroundServer(create_app(demo_policy), port=port)
    except OSError as exc:  # the port in use: an OSError traceback, the backend left running
        backend.stop()
        workdir.cleanup()
        print(
            f"tokenweir demo: cannot listen on 127.0.0.1:{port}: {exc.strerror}; "
            "give another --port (0: any free one)",
            file=sys.stderr,
        )
        return CANNOT_SERVE
    # SIGINT too: a shell that starts the demo in the background (`tokenweir demo &` in a
    # script, some CI runners) has it ignored, and Python would then never raise Ctrl-C's
    # KeyboardInterrupt, leaving the demo and its folder behind.
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        base_url = gateway.start()
        print(f"tokenweir demo: simulated backend on {backend_url}, gateway on {base_url}")
        print(
            f"The ledger holds a simulated day before this hour: {len(day):,} requests from "
            f"{len(demotraffic.TENANT_PROFILES)} tenants (written to it directly, not sent).\n"
        )
        with httpx.Client(base_url=base_url, timeout=30) as client:
            for call in _CALLS:
                print(_send(client, call))
        _print_usage(ledger, len(_CALLS), live_start)
        _print_next_steps(base_url, ledger)
        if keep_serving:
            print("\nServing until Ctrl-C.")
            threading.Event().wait()
    except KeyboardInterrupt:
        print()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        gateway.stop()
        backend.stop()
        workdir.cleanup()
    return 0


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM and SIGINT end the demo as Ctrl-C does, so its temporary folder goes either way."""
    raise KeyboardInterrupt


def _send(client: httpx.Client, call: _Call) -> str:
    headers = {"authorization": f"Bearer {DEMO_KEYS[call.tenant]}"}
    started = time.perf_counter()
    first_token_s: float | None = None
    usage: dict[str, Any] = {}
    with client.stream("POST", call.path, json=call.body, headers=headers) as response:
        if call.body.get("stream"):
            for line in response.iter_lines():
                if first_token_s is None and '"content":"' in line and '"content":""' not in line:
                    first_token_s = time.perf_counter() - started
                elif '"prompt_tokens"' in line:
                    usage = orjson.loads(line.removeprefix("data:"))["usage"]
        else:
            response.read()
            if response.status_code == 200:
                usage = orjson.loads(response.content).get("usage") or {}
        elapsed_s = time.perf_counter() - started
        status, request_id = response.status_code, response.headers.get("x-request-id", "")
        shaped = response.headers.get("x-tokenweir-shaped")
        cache = response.headers.get("x-tokenweir-cache", "bypass")
        error = "" if status == 200 else orjson.loads(response.content)["error"]["code"]
    line = f"  {call.tenant:<12} {call.what:<24} -> {status} {error}"
    if status == 200:
        line += f" in {elapsed_s * 1000:.0f} ms"
        if first_token_s is not None:
            line += f", first token after {first_token_s * 1000:.0f} ms"
        if usage:
            line += f", tokens in {usage.get('prompt_tokens')}"
            if "completion_tokens" in usage:
                line += f" out {usage['completion_tokens']}"
    if shaped:
        line += f" (shaped: {shaped})"
    if cache != "bypass":
        line += f" (cache: {cache})"
    return f"{line}  [{request_id}]"


def _print_usage(ledger: str, requests: int, since: float) -> None:
    """What `tokenweir report` shows for the traffic above, once the ledger has written it."""
    deadline = time.monotonic() + 5
    while _recorded(ledger, since) < requests and time.monotonic() < deadline:
        time.sleep(0.05)  # the ledger's writer commits every 50 ms
    print("\nUsage and cost of these requests, from the ledger (tokenweir report):\n")
    args = argparse.Namespace(
        tenant=None, since=iso_utc(since), until=None, by="model", format="table",
        ledger=ledger, config=None,
    )  # fmt: skip
    report.main(args)


def _recorded(ledger: str, since: float) -> int:
    async def count() -> int:
        reader = open_ledger(ledger, read_only=True)
        try:
            await reader.start()
            return sum(record.ts >= since for record in await reader.latest(None, 1000))
        except LedgerError:
            return 0  # not created yet
        finally:
            await reader.aclose()

    return runloop.run(count())


def _print_next_steps(base_url: str, ledger: str) -> None:
    key = DEMO_KEYS["research"]
    print(
        f"""
Try it yourself (the research tenant's key is {key}):
  curl -N {base_url}/v1/chat/completions -H 'Authorization: Bearer {key}' \\
       -H 'Content-Type: application/json' \\
       -d '{{"model":"mock-llm","stream":true,"messages":[{{"role":"user","content":"hi"}}]}}'
  OpenAI SDK:  OpenAI(base_url="{base_url}/v1", api_key="{key}")
  Models:      {base_url}/v1/models   Health: {base_url}/healthz   Ready: {base_url}/readyz
  Usage:       tokenweir report --ledger {ledger} (while the demo runs)
               curl -H 'Authorization: Bearer {DEMO_ADMIN_KEY}' '{base_url}/api/usage?since=1d'

Dashboard: {base_url}/dashboard
  log in with {DEMO_ADMIN_KEY} (admin: every tenant) or a tenant's key (only that tenant),
  e.g. {DEMO_KEYS["support-bot"]}""",
        file=sys.stdout,
    )
