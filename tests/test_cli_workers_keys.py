"""`tokenweir serve --workers N` with its Redis down: a worker started again meanwhile (after a
crash) knows the runtime keys its sibling knows, and not the ones revoked."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx

from proxy.policy.units import hash_key
from tests.redis_server import RedisProcess
from tests.reliability.state import TENANT, policy_text
from tests.test_cli_reload import tokenweir_serve
from tests.test_cli_workers import CHAT, _eventually
from tests.test_reload import ADMIN, ADMIN_KEY

_WAIT_S = 60.0  # a limit on a loaded 2-core machine, not a measurement


def test_a_worker_restarted_while_redis_is_down_knows_the_runtime_keys(
    backend_url: str, tmp_path: Path
) -> None:
    """The worker the supervisor started again while Redis was down had no runtime keys until
    Redis came back: the key its sibling took (storage errors let requests through by default)
    was refused there, 401. Now both take it; a key revoked before stays refused on both."""
    redis = RedisProcess(["--appendonly", "yes"])  # its keys outlive its stop
    redis.start()
    try:
        config = tmp_path / "policy.yaml"
        admin = f"admin_keys: [{hash_key(ADMIN_KEY)}]\n"
        config.write_text(policy_text(backend_url, redis.url) + admin)
        with tokenweir_serve(config, "--workers", "2") as (_, url):
            kept = _created_key(url)
            revoked = _created_key(url)
            gone = httpx.delete(url + f"/admin/keys/{revoked[0]}", headers=ADMIN)
            assert gone.status_code == 200
            both = (kept[1], revoked[1])
            _eventually(lambda: set(_statuses(url, *both).values()) == {(200, 401)})
            redis.stop()
            pids = set(_statuses(url, *both))
            os.kill(max(pids), signal.SIGKILL)  # a crash: the supervisor starts another
            _eventually(lambda: len(set(_statuses(url, *both)) - pids) == 1)
            assert set(_statuses(url, *both).values()) == {(200, 401)}  # on both workers
            redis.start()
            _eventually(lambda: set(_statuses(url, *both).values()) == {(200, 401)})
    finally:
        redis.close()


def _created_key(url: str) -> tuple[str, str]:
    created = httpx.post(url + "/admin/keys", json={"tenant": TENANT}, headers=ADMIN)
    assert created.status_code == 201, created.text
    return created.json()["id"], created.json()["key"]


def _statuses(url: str, kept: str, revoked: str) -> dict[int, tuple[int, int]]:
    """On each of the two workers (new connections until both answered), by pid: the status
    of a chat with the `kept` key, and of one with the `revoked` key."""
    found: dict[int, tuple[int, int]] = {}
    began = time.monotonic()
    while len(found) < 2:
        assert time.monotonic() - began < _WAIT_S, f"one worker answered: {found}"
        try:
            with httpx.Client(base_url=url, timeout=_WAIT_S) as http:
                pid = http.get("/readyz?backends=skip").json()["pid"]
                first = http.post("/v1/chat/completions", json=CHAT, headers=_bearer(kept))
                second = http.post("/v1/chat/completions", json=CHAT, headers=_bearer(revoked))
        except httpx.TransportError:  # a connection the killed worker had taken
            continue
        found[int(pid)] = (first.status_code, second.status_code)
    return found


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}
