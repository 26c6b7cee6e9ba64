"""A gateway loads the heavy libraries only for the features its policy turns on: numpy (about
15 MB of RSS) only with the semantic cache."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

POLICY = """
storage: memory
{embedder}
backends: [{{name: b, url: "http://127.0.0.1:9/v1", models: [m, e]}}]
models: {{m: {{}}, e: {{}}}}
tenants:
  t: {{api_keys: [{key}], models: [m], cache: {{mode: {mode}}}}}
"""

BUILD = """
import asyncio, sys
from proxy.clock import SystemClock
from proxy.gateway import Gateway
from proxy.policy import parse_policy

async def main() -> None:
    gateway = Gateway.build(parse_policy(sys.stdin.read(), environ={}), SystemClock())
    await gateway.aclose()

asyncio.run(main())
print(sorted(name for name in ("numpy", "tiktoken", "onnxruntime") if name in sys.modules))
"""


@pytest.mark.parametrize(
    ("mode", "embedder", "loaded"),
    [
        ("exact", "", []),
        ("semantic", "embedder: {model: e, timeout: 2s}", ["numpy"]),
    ],
)
def test_numpy_is_loaded_only_for_the_semantic_cache(
    mode: str, embedder: str, loaded: list[str]
) -> None:
    key = "sha256:" + "ab" * 32
    policy = POLICY.format(embedder=embedder, key=key, mode=mode)
    built = subprocess.run(
        [sys.executable, "-c", BUILD], input=policy, cwd=ROOT, capture_output=True, text=True,
        timeout=120, check=True,
    )  # fmt: skip
    assert built.stdout.strip() == repr(loaded)
