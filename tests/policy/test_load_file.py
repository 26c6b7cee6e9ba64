"""The policy file as the commands read it: once (a FIFO, `--config <(...)`, has its bytes only
once), and only up to a size a policy file can have (`/dev/zero` is no policy)."""

from __future__ import annotations

import os
import re
import resource
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from proxy.policy.load import MAX_POLICY_BYTES
from tests.conftest import ALPHA_KEY, BACKEND_KEY, BETA_KEY, policy_text
from tests.servers import free_port, wait_healthy

_ADDRESS_SPACE = 3 << 30  # far more than the commands need; /dev/zero read whole needs it all


def _bounded() -> None:
    """In the child: a memory limit, so a command that reads /dev/zero whole fails in a second
    or so (MemoryError) rather than taking the test machine's memory first."""
    resource.setrlimit(resource.RLIMIT_AS, (_ADDRESS_SPACE, _ADDRESS_SPACE))


_ENV = {**os.environ, "BACKEND_KEY": BACKEND_KEY, "BETA_KEY": BETA_KEY}


def _tokenweir(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy", *args], capture_output=True, text=True, timeout=120,
        check=False, preexec_fn=_bounded, env=_ENV,
    )  # fmt: skip


@pytest.mark.parametrize("serve", [False, True])
def test_a_file_past_the_size_of_a_policy_is_refused_in_one_line(serve: bool) -> None:
    """`tokenweir policy check /dev/zero` read until memory ran out: a MemoryError traceback."""
    command = ("serve", "--port", str(free_port()), "--config") if serve else ("policy", "check")
    done = _tokenweir(*command, "/dev/zero")
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"/dev/zero:0: more than {MAX_POLICY_BYTES >> 20} MiB" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_policy_just_under_the_size_is_read(tmp_path: Path) -> None:
    """The bound is on the file's bytes: a policy padded with a comment to the size still loads."""
    config = tmp_path / "policy.yaml"
    text = policy_text("http://127.0.0.1:9")
    config.write_text(text + "#" * (MAX_POLICY_BYTES - len(text.encode()) - 1) + "\n")
    done = _tokenweir("policy", "check", "--skip-tokenizers", str(config))
    assert done.returncode == 0, done.stderr[-2000:]


def test_serve_and_policy_check_read_a_policy_from_a_fifo(backend_url: str, tmp_path: Path) -> None:
    """`serve --config <(...)` read the policy at the command and again in the app, which found
    the FIFO empty: a PolicyError traceback ('the policy file is empty'), status 1."""
    config = tmp_path / "policy.yaml"
    config.write_text(policy_text(backend_url))
    python = shlex.quote(sys.executable)
    check = subprocess.run(
        ["bash", "-c", f"{python} -m proxy policy check --skip-tokenizers <(cat {config})"],
        capture_output=True, text=True, timeout=120, check=False, env=_ENV,
    )  # fmt: skip
    assert check.returncode == 0, check.stderr[-2000:]
    assert ": ok (2 tenants" in check.stdout
    port = free_port()
    serve = f"exec {python} -m proxy serve --port {port} --no-access-log --config <(cat {config})"
    with (tmp_path / "serve.log").open("wb") as log:
        process = subprocess.Popen(["bash", "-c", serve], stderr=log, env=_ENV)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process)
        models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {ALPHA_KEY}"})
        assert [model["id"] for model in models.json()["data"]] == ["mock-llm", "mock-embed"]
    finally:
        process.terminate()
        process.wait(timeout=60)
    assert b"Traceback" not in (tmp_path / "serve.log").read_bytes()


def test_policy_check_dash_reads_standard_input_up_to_the_size(tmp_path: Path) -> None:
    """`render-policy | tokenweir policy check -` looked for a file named `-`; standard input
    is read through the same cap as a file (`< /dev/zero` is refused, not read to the end)."""
    config = tmp_path / "policy.yaml"
    config.write_text(policy_text("http://127.0.0.1:9"))
    command = [sys.executable, "-m", "proxy", "policy", "check", "--skip-tokenizers", "-"]
    with config.open("rb") as stdin:
        done = subprocess.run(
            command, stdin=stdin, capture_output=True, text=True, timeout=120, check=False,
            preexec_fn=_bounded, env=_ENV,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("<stdin>: ok (2 tenants")
    with open(os.devnull, "rb") as empty, open("/dev/zero", "rb") as zeros:
        for stdin, says in ((zeros, f"<stdin>:0: more than {MAX_POLICY_BYTES >> 20} MiB"),
                            (empty, "<stdin>:1: the policy file is empty")):  # fmt: skip
            done = subprocess.run(
                command, stdin=stdin, capture_output=True, text=True, timeout=120,
                check=False, preexec_fn=_bounded, env=_ENV,
            )  # fmt: skip
            assert done.returncode == 1, done.stderr[-2000:]
            assert says in done.stderr
            assert "Traceback" not in done.stderr


@pytest.mark.parametrize("serve", [False, True])
def test_a_fifo_past_the_size_is_refused_in_one_line(serve: bool) -> None:
    """`--config <(...)` goes through the same cap: a pipe has no size to refuse it by first."""
    python = shlex.quote(sys.executable)
    command = f"serve --port {free_port()} --config" if serve else "policy check"
    done = subprocess.run(
        ["bash", "-c", f"{python} -m proxy {command} <(head -c 17M /dev/zero)"],
        capture_output=True, text=True, timeout=120, check=False, preexec_fn=_bounded, env=_ENV,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    assert re.search(rf"/dev/fd/\d+:0: more than {MAX_POLICY_BYTES >> 20} MiB", done.stderr)
    assert "Traceback" not in done.stderr
