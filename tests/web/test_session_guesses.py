"""A wrong key tried on the dashboard or /api/usage leaves a trace in the log, as one on the API
routes does in the access log; the key itself never does."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import ADMIN_KEY, ALPHA_KEY
from tests.web.usage_ledger import usage_gateway

LOGGER = "tokenweir.dashboard"


@pytest.fixture(scope="module")
def gateway(backend_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with usage_gateway(backend_url, tmp_path_factory.mktemp("guesses")) as url:
        yield url


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_wrong_keys_are_logged_with_the_place_and_address_never_the_key(
    gateway: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with httpx.Client(base_url=gateway) as client:
        login = client.post("/dashboard/login", data={"key": "guess-one"})
        assert login.status_code == 401
        # A reverse proxy on 127.0.0.1 (trusted by default) names the real client.
        forwarded = {"authorization": "Bearer guess-two", "x-forwarded-for": "203.0.113.7"}
        assert client.get("/dashboard", headers=forwarded).status_code == 401
        usage = client.get("/api/usage", headers={"authorization": "Bearer guess-three"})
        assert usage.status_code == 401
    assert warnings(caplog) == [
        "refused a key this gateway does not know: the dashboard login from 127.0.0.1",
        "refused a key this gateway does not know: a dashboard page from 203.0.113.7",
        "refused a key this gateway does not know: /api/usage from 127.0.0.1",
    ]
    assert not any("guess" in line for line in caplog.text.splitlines())


def test_no_key_and_right_keys_log_nothing(gateway: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with httpx.Client(base_url=gateway) as client:
        assert client.get("/dashboard").status_code == 303  # to the login form
        assert client.get("/api/usage").status_code == 401
        assert client.post("/dashboard/login", data={"key": " "}).status_code == 401
        assert client.post("/dashboard/login", data={"key": ALPHA_KEY}).status_code == 303
        assert client.get("/dashboard").status_code == 200
        admin = {"authorization": f"Bearer {ADMIN_KEY}"}
        assert client.get("/api/usage", headers=admin).status_code == 200
    assert warnings(caplog) == []
