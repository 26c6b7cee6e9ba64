"""Logging out of the dashboard ends the session itself, not just the browser's copy of the
cookie: a copied cookie stops reading usage, on every replica sharing the storage."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from proxy import services
from proxy.app import SESSION_TTL_S, create_app
from proxy.clock import FakeClock
from proxy.storage import Storage
from proxy.storage.sessions import EndedSessions, MemoryEndedSessions
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


def test_ended_sessions_are_forgotten_once_their_cookies_expire(
    backend_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key holder logging in and out in a loop, on memory storage: the ended sessions held
    are those whose cookies have not expired yet (they were all kept for good, one a logout)."""
    opened: list[EndedSessions] = []
    open_ended_sessions = services.open_ended_sessions

    def recorded(storage: Storage) -> EndedSessions:
        opened.append(open_ended_sessions(storage))
        return opened[-1]

    monkeypatch.setattr(services, "open_ended_sessions", recorded)
    clock = FakeClock(NOW)
    path = tmp_path / "ledger.db"
    write_ledger(path, records())
    with serve(create_app(dashboard_policy(backend_url, path), clock=clock)) as gateway:
        [ended] = opened
        assert isinstance(ended, MemoryEndedSessions)
        for _ in range(30):
            httpx.post(gateway + "/dashboard/logout", cookies={COOKIE: login(gateway, ALPHA_KEY)})
        assert len(ended) == 30
        clock.advance(SESSION_TTL_S + 1)
        cookie = login(gateway, ALPHA_KEY)
        httpx.post(gateway + "/dashboard/logout", cookies={COOKIE: cookie})
        assert len(ended) == 1
        assert reads_usage(gateway, cookie) == 401
        assert reads_usage(gateway, login(gateway, ALPHA_KEY)) == 200
