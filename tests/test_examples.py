"""The examples in examples/ run as written against a live gateway."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.app import DEFAULT_POLICY, create_app
from proxy.policy import load_policy
from tests.servers import serve

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.fixture(scope="module")
def demo_gateway(backend_url: str) -> Iterator[str]:
    """The gateway on the shipped demo policy, its backend pointed at the simulated one."""
    policy = load_policy(DEFAULT_POLICY.with_name("demo.yaml"), environ={})
    backends = tuple(b.model_copy(update={"url": backend_url + "/v1"}) for b in policy.backends)
    with serve(create_app(policy.model_copy(update={"backends": backends}))) as url:
        yield url


def test_openai_client_example(demo_gateway: str) -> None:
    env = {**os.environ, "TOKENWEIR_BASE_URL": demo_gateway + "/v1"}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "openai_client.py")],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "non-stream:" in done.stdout
    assert "completion_tokens=32" in done.stdout
    assert "models: ['mock-llm', 'mock-llm-small', 'mock-embed']" in done.stdout


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_example(demo_gateway: str) -> None:
    env = {**os.environ, "BASE": demo_gateway}
    done = subprocess.run(
        ["sh", str(EXAMPLES / "curl.sh")],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert '"object":"chat.completion"' in done.stdout
    assert "data: [DONE]" in done.stdout
    assert '"code":"invalid_api_key"' in done.stdout
