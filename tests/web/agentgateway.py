"""A real gateway with a SQLite ledger over the real mock backend, for the Responses and Messages
API tests: tenants with no limits, with an output cap and system prompt, with a tiny quota, with
an input limit, with the response cache on, and with one request a minute."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from starlette.types import ASGIApp

from proxy.app import create_app
from proxy.ledger import UsageRecord
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from proxy.tools.mock import backend as mockbackend
from tests.servers import serve
from tests.shared import tokenizer_file
from tests.web.test_billing import ledger_records

OPEN_KEY = "tw-agents-open"
CAPPED_KEY = "tw-agents-capped"
POOR_KEY = "tw-agents-poor"
SHORT_KEY = "tw-agents-short"
CACHED_KEY = "tw-agents-cached"
LIMITED_KEY = "tw-agents-limited"
COUNTING_KEY = "tw-agents-counting"
SYSTEM_PROMPT = "Answer in one short sentence."
OUTPUT_CAP = 3
PRICE_IN_NUSD_PER_TOKEN = 1_000  # input_per_1m: 1.0 USD
PRICE_OUT_NUSD_PER_TOKEN = 2_000  # output_per_1m: 2.0 USD


def qwen_spec() -> str:
    return f"{tokenizer_file('qwen2.5/qwen.tiktoken')}#qwen2.5"


@contextmanager
def exact_gateway(backend: ASGIApp, ledger: Path, tenants: str) -> Iterator[str]:
    """A real gateway's URL, over `backend` serving exact-llm (Qwen2.5's tokenizer), with a
    SQLite ledger and the policy's `tenants` (YAML lines, indented two spaces)."""
    with serve(backend) as backend_url:
        text = f"""
storage: memory
ledger: sqlite:///{ledger}
backends: [{{name: liar, url: "{backend_url}/v1", models: [exact-llm]}}]
models:
  exact-llm: {{tokenizer: "{qwen_spec()}"}}
tenants:
{tenants}"""
        with serve(create_app(parse_policy(text, file="exact.yaml", environ={}))) as url:
            yield url


@dataclass(frozen=True, slots=True)
class AgentGateway:
    url: str
    backend_url: str
    ledger: Path

    def stats(self) -> dict[str, object]:
        stats: dict[str, object] = httpx.get(self.backend_url + "/mock/stats", timeout=10).json()
        return stats

    def reset(self) -> None:
        httpx.post(self.backend_url + "/mock/stats/reset", timeout=10).raise_for_status()

    def records(self, request_id: str) -> list[UsageRecord]:
        """Every ledger row of one request as it stands (a running stream's checkpoint, or its
        final record, which replaces the checkpoint)."""
        return [r for r in ledger_records(self.ledger, 0) if r.request_id == request_id]

    def record(self, request_id: str) -> UsageRecord:
        """The ledger's final record of one request, once it is written (within 10 s): a long
        stream's checkpoint, written while it runs, is not it."""
        deadline = time.monotonic() + 10
        while True:
            found = [r for r in self.records(request_id) if not r.checkpoint]
            if found:
                return found[0]
            assert time.monotonic() < deadline, f"no ledger record of {request_id}"
            time.sleep(0.05)


def wait_for_stat(gateway: AgentGateway, name: str, value: int, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        seen = gateway.stats()[name]
        assert isinstance(seen, int)
        if seen >= value:
            return
        assert time.monotonic() < deadline, f"{name} is {seen} after {within_s} s"
        time.sleep(0.01)


def _policy_text(backend_url: str, ledger: Path) -> str:
    return f"""
storage: memory
ledger: sqlite:///{ledger}
upstream: {{connect_timeout: 2s, read_timeout: 10s}}
backends:
  - name: mock
    url: {backend_url}/v1
    models: [mock-llm, mock-small]
models:
  mock-llm: {{tokenizer: "{qwen_spec()}", price: {{input_per_1m: 1.0, output_per_1m: 2.0}}}}
  mock-small: {{}}
tenants:
  open:
    api_keys: [{hash_key(OPEN_KEY)}]
    models: [mock-llm]
  capped:
    api_keys: [{hash_key(CAPPED_KEY)}]
    models: [mock-llm]
    budget: {{max_output_tokens: {OUTPUT_CAP}, system_prompt: "{SYSTEM_PROMPT}"}}
  poor:
    api_keys: [{hash_key(POOR_KEY)}]
    models: [mock-llm]
    budget: {{tokens_per_day: 50}}
  short:
    api_keys: [{hash_key(SHORT_KEY)}]
    models: [mock-llm]
    budget: {{max_input_tokens: 60}}
  cached:
    api_keys: [{hash_key(CACHED_KEY)}]
    models: [mock-llm]
    cache: {{mode: always}}
  limited:
    api_keys: [{hash_key(LIMITED_KEY)}]
    models: [mock-llm]
    limits: {{requests_per_minute: 1}}
  counting:
    api_keys: [{hash_key(COUNTING_KEY)}]
    models: [mock-llm]
    limits: {{requests_per_minute: 2}}
"""


@contextmanager
def agent_gateway(folder: Path) -> Iterator[AgentGateway]:
    """The mock at 1,000 tokens/s (a 20,000-token answer takes 20 s: time to leave mid-way)."""
    ledger = folder / "ledger.db"
    with serve(mockbackend.create_app(ttft_ms=0, tokens_per_second=1000)) as backend_url:
        policy = parse_policy(_policy_text(backend_url, ledger), file="agents.yaml", environ={})
        with serve(create_app(policy)) as url:
            yield AgentGateway(url, backend_url, ledger)
