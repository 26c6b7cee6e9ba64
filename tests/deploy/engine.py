"""The container engine for the deploy tests: found, or the test skipped (failed in CI).

CI starts the engine (../shared/tools/containers/engine.sh) and sets TOKENWEIR_REQUIRE_ENGINE=1,
so these tests can never silently skip there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
# Inside a container: listen on its own network interface, not the host's.
EVERY_INTERFACE = "0.0.0.0"  # noqa: S104
_REASON = (
    "needs a running container engine (docker); start one with "
    "../shared/tools/containers/engine.sh start"
)


def require_engine() -> None:
    """Skip (fail under TOKENWEIR_REQUIRE_ENGINE=1) unless `docker info` answers."""
    problem = None
    if shutil.which("docker") is None:
        problem = "the docker command is not installed"
    else:
        info = subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        if info.returncode != 0:
            problem = "the docker daemon does not answer"
    if problem is None:
        return
    if os.environ.get("TOKENWEIR_REQUIRE_ENGINE") == "1":
        pytest.fail(f"{_REASON}: {problem}")
    pytest.skip(f"{_REASON}: {problem}")


def docker(*args: str, timeout_s: float = 120, check: bool = True) -> str:
    """Run `docker ARGS`; its stdout, stripped. A failure shows docker's stderr."""
    done = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if check and done.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed:\n{done.stderr}{done.stdout}")
    return done.stdout.strip()


def compose_command() -> list[str]:
    """`docker compose` (v2) when installed, else `docker-compose` (v1)."""
    plugin = subprocess.run(
        ["docker", "compose", "version"], capture_output=True, timeout=30, check=False
    )
    if plugin.returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if os.environ.get("TOKENWEIR_REQUIRE_ENGINE") == "1":
        pytest.fail("neither `docker compose` nor `docker-compose` is installed")
    pytest.skip("neither `docker compose` nor `docker-compose` is installed")


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@contextmanager
def network() -> Iterator[str]:
    name = unique("tw-test-net")
    docker("network", "create", name)
    try:
        yield name
    finally:
        docker("network", "rm", name, check=False)


@contextmanager
def container(
    image: str, *args: str, name: str | None = None, options: Sequence[str] = ()
) -> Iterator[str]:
    """A detached container of `image` running `args`, removed (with its anonymous volumes)
    afterwards."""
    name = name or unique("tw-test")
    docker("run", "-d", "--name", name, *options, image, *args)
    try:
        yield name
    finally:
        docker("rm", "-f", "-v", name, check=False)


def host_url(name: str, port: int) -> str:
    """`http://127.0.0.1:N` for the container's published `port` (-p 127.0.0.1::port)."""
    published = docker("port", name, f"{port}/tcp").splitlines()[0]
    return "http://127.0.0.1:" + published.rsplit(":", 1)[1]


def inspect(name: str) -> dict[str, object]:
    found: list[dict[str, object]] = json.loads(docker("inspect", name))
    return found[0]


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.25)


def health(name: str) -> str:
    state = inspect(name)["State"]
    assert isinstance(state, dict)
    return str(state.get("Health", {}).get("Status", "none"))


def wait_healthy(name: str, timeout_s: float = 90) -> None:
    """The container's own HEALTHCHECK reports healthy (its logs shown if it never does)."""
    try:
        wait_for(lambda: health(name) == "healthy", f"{name} to be healthy", timeout_s)
    except AssertionError:
        logs = docker("logs", "--tail", "40", name, check=False)
        raise AssertionError(f"{name} is {health(name)}; its log:\n{logs}") from None
