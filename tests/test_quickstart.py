"""README's Quick start, step by step, as a user types it: real processes, the default policy."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson

from tests.servers import free_port, wait_healthy

REPO_ROOT = Path(__file__).resolve().parents[1]
KEY = "my-app-key"


@contextmanager
def running(args: list[str], cwd: Path, env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(
        [sys.executable, "-m", "proxy", *args],
        cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process.stderr is not None:
            process.stderr.close()


def test_the_quick_start_runs_as_written(tmp_path: Path) -> None:
    shell = {k: v for k, v in os.environ.items() if not k.startswith("TOKENWEIR_")}
    backend_port, gateway_port = free_port(), free_port()
    server_env = {
        **shell,
        "TOKENWEIR_API_KEY": KEY,
        "TOKENWEIR_BACKEND_URL": f"http://127.0.0.1:{backend_port}/v1",
    }
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    with running(["mock-backend", "--port", str(backend_port)], tmp_path, shell) as backend:
        wait_healthy(f"http://127.0.0.1:{backend_port}", backend, path="/v1/models")
        with running(["serve", "--port", str(gateway_port)], tmp_path, server_env) as gateway:
            wait_healthy(gateway_url, gateway)
            client_env = {
                **server_env,  # the same shell holds the gateway's key and the client's
                "TOKENWEIR_CLIENT_KEY": KEY,
                "TOKENWEIR_BASE_URL": gateway_url + "/v1",
            }
            example = subprocess.run(
                [sys.executable, str(REPO_ROOT / "examples" / "openai_client.py")],
                capture_output=True, text=True, env=client_env, timeout=120, check=False,
            )  # fmt: skip
            assert example.returncode == 0, example.stderr
            assert "completion_tokens=32" in example.stdout
            _run_readme_snippets(gateway_port, tmp_path, shell)
    # `tokenweir report` from a shell that never exported the gateway's key.
    report = subprocess.run(
        [sys.executable, "-m", "proxy", "report", "--format", "json"],
        cwd=tmp_path, env=shell, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert report.returncode == 0, report.stderr
    rows = orjson.loads(report.stdout)["rows"]
    assert (tmp_path / "tokenweir.db").exists()
    # The example's two requests, the SDK snippet's two and curl's one.
    assert sum(row["requests"] for row in rows if row["tenant"] == "default") == 5, rows


def _readme_block(language: str, holding: str) -> str:
    """The README's fenced block in `language` that holds `holding`, as written."""
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M)
    return next(block for block in blocks if holding in block)


def _run_readme_snippets(port: int, cwd: Path, env: dict[str, str]) -> None:
    """The Quick start's SDK snippet and curl line, only the port changed."""
    python = _readme_block("python", "from openai import OpenAI").replace(":8080", f":{port}")
    sdk = subprocess.run(
        [sys.executable, "-c", python],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert sdk.returncode == 0, sdk.stderr
    assert sdk.stdout.strip(), "the streamed reply printed nothing"
    assert shutil.which("curl"), "the README's curl line needs curl (apt-get install curl)"
    curl = _readme_block("sh", "curl -N").replace(":8080", f":{port}")
    streamed = subprocess.run(
        ["sh", "-c", curl],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout.rstrip().endswith("data: [DONE]"), streamed.stdout[-300:]
