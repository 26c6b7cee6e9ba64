"""The image, built once per session for every deploy test that runs it."""

from __future__ import annotations

import time

import pytest

from tests.deploy.engine import REPO_ROOT, docker, require_engine

IMAGE = "tokenweir:test"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "engine: builds or runs containers; skipped without a container engine"
    )


def build(tag: str, *build_args: str) -> float:
    """`docker build` of the repository's Dockerfile; how long it took, in seconds."""
    started = time.monotonic()
    docker(
        "build", "--network", "host", "-q", "-t", tag, *build_args, str(REPO_ROOT),
        timeout_s=900,
    )  # fmt: skip
    return time.monotonic() - started


@pytest.fixture(scope="session")
def image() -> str:
    """The image of this checkout, tagged tokenweir:test (the layer cache makes rebuilds fast)."""
    require_engine()
    print(f"\nbuilt {IMAGE} in {build(IMAGE):.0f} s")
    return IMAGE
