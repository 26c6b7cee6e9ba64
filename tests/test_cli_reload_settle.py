"""A SIGHUP or `POST /admin/reload` sent while the policy file is being written: the reload
waits for the file to hold still, under `serve --workers 2`, instead of applying a piece of it."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.test_cli_reload import tokenweir_serve
from tests.test_reload import ADMIN, CHAT, NEW_KEY, policy_text

_WAIT_S = 60.0  # a limit on a loaded 2-core machine, not a measurement


def _signal_supervisor(url: str, supervisor: int) -> None:
    os.kill(supervisor, signal.SIGHUP)


def _admin_reload(url: str, supervisor: int) -> None:
    def post() -> None:  # it answers once the file held still: after the writing ends
        httpx.post(url + "/admin/reload", headers=ADMIN, timeout=_WAIT_S)

    threading.Thread(target=post, daemon=True).start()


@pytest.mark.parametrize("reload", [_signal_supervisor, _admin_reload], ids=["sighup", "admin"])
def test_a_reload_asked_for_mid_write_applies_the_whole_file(
    backend_url: str, redis_url: str, tmp_path: Path, reload: Callable[[str, int], None]
) -> None:
    """A file written in pieces (a slow copy, a script writing as it goes) and a reload asked
    for meanwhile: every worker applied what it found, here a policy without the last tenant,
    and that reload revoked the tenant's runtime keys for good (401 once the whole file was
    served). Now the reload applies the file once it holds still and the key keeps working."""
    config = tmp_path / "policy.yaml"
    text = policy_text(backend_url, newcomer=True).replace(
        "storage: memory", f"storage: {redis_url}"
    )
    config.write_text(text)
    head, tail = text.split("  gamma:")
    with tokenweir_serve(config, "--workers", "2") as (process, url):
        created = httpx.post(url + "/admin/keys", json={"tenant": "gamma"}, headers=ADMIN)
        key = created.json()["key"]
        _eventually(lambda: _chat(url, key) == 200, "the new key works")
        with config.open("w") as writing:
            writing.write(head)
            writing.flush()
            reload(url, process.pid)
            for line in range(60):  # three seconds of a valid file without gamma, growing
                writing.write(f"    # line {line}\n")
                writing.flush()
                time.sleep(0.05)
            writing.write("  gamma:" + tail)
        whole = _digest(config)
        _eventually(lambda: _served(url) == {whole}, "every worker serves the whole file")
        assert {_chat(url, key) for _ in range(6)} == {200}
        assert {_chat(url, NEW_KEY) for _ in range(6)} == {200}
    assert b"revoked" not in config.with_suffix(".log").read_bytes()


def _chat(url: str, key: str) -> int:
    with httpx.Client() as fresh:  # a new connection: any worker may answer
        answer = fresh.post(
            url + "/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {key}"}
        )
    return answer.status_code


def _served(url: str) -> set[object]:
    """The versions six fresh connections (either worker) found served."""
    found = set()
    for _ in range(6):
        with httpx.Client() as fresh:
            found.add(fresh.get(url + "/readyz?backends=skip").json()["policy_hash"])
    return found


def _digest(config: Path) -> str:
    return hashlib.sha256(config.read_bytes()).hexdigest()[:16]


def _eventually(check: Callable[[], bool], what: str) -> None:
    began = time.monotonic()
    while not check():
        assert time.monotonic() - began < _WAIT_S, f"not within {_WAIT_S:.0f} s: {what}"
        time.sleep(0.1)
