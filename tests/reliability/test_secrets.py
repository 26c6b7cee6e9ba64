"""No key leaves the gateway: not the tenants', the admin's nor the backend's, in any answer,
header, access-log line or server log, whatever the request did."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from proxy.policy.units import hash_key
from tests.servers import free_port, wait_healthy

TENANT_KEY = "tw-secret-tenant-key-1f2e3d"
ADMIN_KEY = "tw-secret-admin-key-4c5b6a"
BACKEND_KEY = "sk-secret-backend-key-9z8y7x"
WRONG_KEY = "tw-secret-wrong-key-0a0b0c"
CHAT = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def _requests(http: httpx.Client) -> list[httpx.Response]:
    tenant = {"authorization": f"Bearer {TENANT_KEY}"}
    wrong = {"authorization": f"Bearer {WRONG_KEY}"}
    return [
        http.post("/v1/chat/completions", json=CHAT, headers=tenant),
        http.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=tenant),
        http.post("/v1/chat/completions", json={**CHAT, "mock_fail": 500}, headers=tenant),
        http.post("/v1/chat/completions", json={**CHAT, "mock_fail": 401}, headers=tenant),
        http.post("/v1/chat/completions", json={**CHAT, "mock_fail": 400}, headers=tenant),
        http.post("/v1/chat/completions", content=b"{", headers=tenant),
        http.post("/v1/chat/completions", json=CHAT, headers={"authorization": WRONG_KEY}),
        http.post("/v1/chat/completions", json=CHAT, headers=wrong),
        http.get("/v1/models", headers=wrong),
        http.get("/api/usage", headers={"authorization": f"Bearer {ADMIN_KEY}"}),
        http.get("/api/usage", headers=wrong),
        http.post("/dashboard/login", data={"key": WRONG_KEY}),
        http.post("/dashboard/login", data={"key": ADMIN_KEY}),
    ]  # fmt: skip


def test_no_key_in_answers_or_logs(backend_url: str, tmp_path: Path) -> None:
    config = tmp_path / "policy.yaml"
    config.write_text(f"""
admin_keys: [{hash_key(ADMIN_KEY)}]
ledger: sqlite:///{tmp_path / "ledger.db"}
backends: [{{name: mock, url: "{backend_url}/v1", api_key: "${{SECRET_BACKEND_KEY}}",
            models: [mock-llm]}}]
models: {{mock-llm: {{}}}}
tenants:
  app: {{api_keys: [{hash_key(TENANT_KEY)}], models: [mock-llm]}}
""")  # fmt: skip
    port = free_port()
    command = [sys.executable, "-m", "proxy", "serve", "--config", str(config)]
    command += ["--port", str(port), "--log-level", "debug"]
    env = {**os.environ, "SECRET_BACKEND_KEY": BACKEND_KEY}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process)
        with httpx.Client(base_url=url, timeout=10) as http:
            answers = _requests(http)
    finally:
        process.terminate()
        stdout, stderr = process.communicate(timeout=30)
    seen = [str(a.headers) + a.text for a in answers] + [stdout.decode(), stderr.decode()]
    assert [a.status_code for a in answers][:3] == [200, 200, 502]
    assert stdout.count(b"\n") >= 8  # the access log did log the /v1 requests
    for text in seen:
        for key in (TENANT_KEY, ADMIN_KEY, BACKEND_KEY, WRONG_KEY):
            assert key not in text
            assert hash_key(key) not in text


@pytest.mark.parametrize("where", ["login", "query"])
def test_a_backend_url_holding_a_secret_is_refused_at_start_without_repeating_it(
    backend_url: str, tmp_path: Path, where: str
) -> None:
    """`http://user:password@host/v1` was accepted: the login was never sent on requests (every
    one failed on a backend that wants it, while `/readyz`'s probe, sent with it, said ready),
    and the whole URL, password and all, went into every backend call's span as `url.full`
    (a `?key=` query too, and the request's path was added after it). Now `serve` and
    `policy check` refuse both, naming the setting to use and not the secret."""
    config = tmp_path / "policy.yaml"
    config.write_text("""
backends: [{name: mock, url: "${BACKEND_URL}", models: [mock-llm]}]
models: {mock-llm: {}}
tenants: {app: {api_keys: ["${TENANT_KEY}"], models: [mock-llm]}}
""")  # fmt: skip
    password = "hunter2-backend-password"
    if where == "login":
        secret_url = backend_url.replace("http://", f"http://bob:{password}@") + "/v1"
    else:
        secret_url = f"{backend_url}/v1?api-key={password}"
    env = {**os.environ, "BACKEND_URL": secret_url, "TENANT_KEY": TENANT_KEY}
    port = free_port()
    serve = [sys.executable, "-m", "proxy", "serve", "--config", str(config), "--port", str(port)]
    process = subprocess.Popen(serve, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_refused(process, f"http://127.0.0.1:{port}")
    finally:
        process.kill()
        stdout, stderr = process.communicate(timeout=30)
    check = [sys.executable, "-m", "proxy", "policy", "check", str(config)]
    checked = subprocess.run(check, env=env, capture_output=True, timeout=60, check=False)
    assert checked.returncode != 0
    for said in (stderr.decode(), checked.stderr.decode()):
        assert "backends[0].url" in said, said
        assert "api_key" in said, said
    for said in (stdout, stderr, checked.stdout, checked.stderr):
        assert password.encode() not in said


def test_a_backend_key_no_header_can_carry_is_refused_at_start(
    backend_url: str, tmp_path: Path
) -> None:
    """A backend key with a character outside ASCII (a typographic dash pasted with it) was
    accepted, and every request to that backend was a bare 500 with a traceback in the log."""
    config = tmp_path / "policy.yaml"
    config.write_text(f"""
backends: [{{name: mock, url: "{backend_url}/v1", api_key: "${{BACKEND_KEY}}", models: [m]}}]
models: {{m: {{}}}}
tenants: {{app: {{api_keys: ["${{TENANT_KEY}}"], models: [m]}}}}
""")  # fmt: skip
    key = "sk-pasted-key\u2013with-a-dash"
    env = {**os.environ, "BACKEND_KEY": key, "TENANT_KEY": TENANT_KEY}
    port = free_port()
    serve = [sys.executable, "-m", "proxy", "serve", "--config", str(config), "--port", str(port)]
    process = subprocess.Popen(serve, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_refused(process, f"http://127.0.0.1:{port}", "a backend key no header can carry")
    finally:
        process.kill()
        _, stderr = process.communicate(timeout=30)
    assert "backends[0].api_key" in stderr.decode()
    assert key.encode() not in stderr


def _wait_refused(
    process: subprocess.Popen[bytes], url: str, why: str = "a backend url carrying a password"
) -> None:
    """Until `process` exits; fails at once should it serve instead."""
    deadline = time.monotonic() + 120
    while process.poll() is None:
        assert time.monotonic() < deadline, "serve neither served nor exited"
        try:
            served = httpx.get(url + "/healthz", timeout=1).status_code
        except httpx.TransportError:
            served = None
        assert served is None, f"serve started on {why}"
        time.sleep(0.1)
    assert process.returncode != 0
