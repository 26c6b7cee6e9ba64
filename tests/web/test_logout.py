"""Logging out of the dashboard ends the session itself, not just the browser's copy of the
cookie: a copied cookie stops reading usage, on every replica sharing the storage."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from proxy.app import create_app
from proxy.clock import FakeClock
from tests.conftest import ALPHA_KEY
from tests.servers import serve
from tests.web.usage_ledger import NOW, dashboard_policy, records, write_ledger

COOKIE = "tokenweir_session"


@contextmanager
def gateways(backend_url: str, directory: Path, storage: str, count: int) -> Iterator[list[str]]:
    """`count` gateways on one ledger and one storage; they share the session secret."""
    path = directory / "ledger.db"
    write_ledger(path, records())
    policy = dashboard_policy(backend_url, path).model_copy(update={"storage": storage})
    with ExitStack() as stack:
        yield [
            stack.enter_context(serve(create_app(policy, clock=FakeClock(NOW))))
            for _ in range(count)
        ]


def login(gateway: str, key: str) -> str:
    answer = httpx.post(gateway + "/dashboard/login", data={"key": key, "next": "/dashboard"})
    assert answer.status_code == 303, answer.text
    return answer.cookies[COOKIE]


def reads_usage(gateway: str, cookie: str) -> int:
    return httpx.get(gateway + "/api/usage", cookies={COOKIE: cookie}).status_code


@pytest.fixture(autouse=True)
def shared_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENWEIR_SESSION_SECRET", "test-logout-secret")


def test_a_logged_out_cookie_no_longer_reads_usage(backend_url: str, tmp_path: Path) -> None:
    with gateways(backend_url, tmp_path, "memory", 1) as [gateway]:
        cookie, other = login(gateway, ALPHA_KEY), login(gateway, ALPHA_KEY)
        assert reads_usage(gateway, cookie) == 200
        answer = httpx.post(gateway + "/dashboard/logout", cookies={COOKIE: cookie})
        assert answer.status_code == 303
        assert reads_usage(gateway, cookie) == 401
        page = httpx.get(gateway + "/dashboard", cookies={COOKIE: cookie})
        assert page.status_code == 303
        assert page.headers["location"].startswith("/dashboard/login")
        assert reads_usage(gateway, other) == 200  # only that session ended


def test_a_logout_on_one_replica_holds_on_the_other(
    backend_url: str, tmp_path: Path, redis_url: str
) -> None:
    with gateways(backend_url, tmp_path, redis_url, 2) as [first, second]:
        cookie = login(first, ALPHA_KEY)
        assert reads_usage(second, cookie) == 200
        httpx.post(first + "/dashboard/logout", cookies={COOKIE: cookie})
        assert reads_usage(second, cookie) == 401
        assert reads_usage(first, login(second, ALPHA_KEY)) == 200
