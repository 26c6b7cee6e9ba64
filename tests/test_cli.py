"""The `tokenweir` command as a user runs it: a real process, real ports."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from proxy.app import DEFAULT_POLICY
from proxy.cli import main
from tests.conftest import ADMIN_KEY, ALPHA_KEY, BACKEND_KEY, BETA_KEY, policy_text
from tests.servers import free_port, wait_healthy


def tokenweir(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def test_policy_check_accepts_the_shipped_demo() -> None:
    done = tokenweir("policy", "check", str(DEFAULT_POLICY.with_name("demo.yaml")))
    assert done.returncode == 0, done.stderr
    assert "ok (3 tenants" in done.stdout


def test_policy_check_names_file_line_and_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(policy_text("http://127.0.0.1:9").replace("storage:", "storgae:"))
    done = tokenweir("policy", "check", str(bad))
    assert done.returncode == 1
    assert f"{bad}:2: storgae: unknown key" in done.stderr


def test_policy_check_loads_the_tokenizers_as_serve_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file that named a tokenizer no one could load passed the check, then failed to
    start (or to reload)."""
    missing = tmp_path / "no-such-tokenizer.json"
    text = policy_text("http://127.0.0.1:9").replace(
        "  mock-small: {}", f'  mock-small: {{tokenizer: "{missing}"}}'
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    monkeypatch.setenv("BACKEND_KEY", BACKEND_KEY)
    monkeypatch.setenv("BETA_KEY", BETA_KEY)
    done = tokenweir("policy", "check", str(bad))
    assert done.returncode == 1
    assert f"model 'mock-small': tokenizer '{missing}'" in done.stderr
    assert "no such file or directory" in done.stderr
    skipped = tokenweir("policy", "check", "--skip-tokenizers", str(bad))
    assert skipped.returncode == 0, skipped.stderr
    assert "ok (2 tenants" in skipped.stdout


def test_policy_check_reports_every_problem_in_one_run_by_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A misspelt key used to hide an unknown model until the key was fixed."""
    monkeypatch.setenv("BACKEND_KEY", BACKEND_KEY)
    monkeypatch.setenv("BETA_KEY", BETA_KEY)
    text = policy_text("http://127.0.0.1:9").replace("storage:", "storgae:")
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("models: [mock-small]", "models: [mock-smal]"))
    done = tokenweir("policy", "check", str(bad))
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"{bad}:2: storgae: unknown key (did you mean storage?)",
        f"{bad}:21: tenants.beta.models[0]: unknown model 'mock-smal' (declare it under models:)",
    ]


def test_hash_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "hash-key", "abc"]) == 0
    assert capsys.readouterr().out.strip().startswith("sha256:ba7816bf")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ttft-ms", "-5"], "tokenweir mock-backend: ttft_ms must be a number >= 0, got -5.0"),
        (["--ttft-ms", "nan"], "tokenweir mock-backend: ttft_ms must be a number >= 0, got nan"),
        (["--load-ttft-ms", "-100"], "load_ttft_ms must be a number >= 0, got -100.0"),
        (["--prefill-ms-per-1k-tokens", "-1"], "prefill_ms_per_1k_tokens must be a number >= 0"),
        (["--prefix-cache", "-3"], "prefix_cache must be >= 0, got -3"),
        (["--port", "99999"], "argument --port: expected a port from 0 to 65535, got '99999'"),
    ],
)
def test_mock_backend_refuses_impossible_settings_in_one_line(
    flags: list[str], message: str
) -> None:
    """-5 was a traceback; the others started a mock that lied: a negative load or prefill
    time sent tokens before the TTFT it claimed, nan never streamed one, and port 99999 was
    served on 34463 (99999 - 65536) while the log said 99999."""
    done = tokenweir("mock-backend", "--port", str(free_port()), *flags, timeout_s=20)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("command", ["serve", "demo"])
def test_a_port_past_65535_is_refused_not_bound_modulo_65536(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `serve --port 99999` listened on 34463 while its log said 99999.
    monkeypatch.setenv("TOKENWEIR_API_KEY", "sk-test")  # the embedded policy's key: it starts
    done = tokenweir(command, "--port", "99999", timeout_s=20)
    assert done.returncode == 2
    assert "argument --port: expected a port from 0 to 65535, got '99999'" in done.stderr


def test_demo_runs_on_a_fresh_machine() -> None:
    done = tokenweir("demo", "--exit", "--port", "0")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert sum(" -> 200 " in line for line in lines) == 6
    assert any("the same, again" in line and "(cache: hit)" in line for line in lines)
    assert any(" -> 403 model_not_allowed" in line for line in lines)
    assert "curl -N" in done.stdout
    assert re.search(r"Dashboard: http://127.0.0.1:\d+/dashboard", done.stdout)
    # The ledger saw the traffic: seven requests, one of them refused.
    total = next(line for line in lines if line.startswith("total"))
    assert total.split()[1:3] == ["7", "1"]


def test_serve_with_two_workers_answers_the_sdk(
    tmp_path: Path, backend_url: str, redis_url: str
) -> None:
    config = tmp_path / "policy.yaml"  # several workers need shared storage: Redis
    config.write_text(policy_text(backend_url).replace("storage: memory", f"storage: {redis_url}"))
    port = free_port()
    env = {**os.environ, "BACKEND_KEY": BACKEND_KEY, "BETA_KEY": BETA_KEY}
    command = [sys.executable, "-m", "proxy", "serve", "--config", str(config)]
    command += ["--port", str(port), "--workers", "2"]
    server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url, server)
        with openai.OpenAI(base_url=base_url + "/v1", api_key=ALPHA_KEY, max_retries=0) as sdk:
            for _ in range(4):
                reply = sdk.chat.completions.create(
                    model="mock-llm", messages=[{"role": "user", "content": "hi"}], max_tokens=3
                )
                assert reply.usage is not None
                assert reply.usage.completion_tokens == 3
    finally:
        server.terminate()
        out, _ = server.communicate(timeout=30)
    access_lines = [line for line in out.decode().splitlines() if line.startswith("{")]
    assert len(access_lines) == 4
    assert all('"tenant":"alpha"' in line for line in access_lines)


@pytest.mark.parametrize(("allowed", "secure"), [(None, True), ("10.9.8.7", False)])
def test_serve_believes_a_forwarded_https_only_from_allowed_proxies(
    tmp_path: Path, backend_url: str, allowed: str | None, secure: bool
) -> None:
    """Behind a TLS proxy the dashboard's cookie is `Secure`: the proxy's X-Forwarded-Proto is
    believed from the loopback addresses by default, from FORWARDED_ALLOW_IPS's if set."""
    config = tmp_path / "policy.yaml"
    config.write_text(policy_text(backend_url))
    port = free_port()
    env = {**os.environ, "BACKEND_KEY": BACKEND_KEY, "BETA_KEY": BETA_KEY}
    env.pop("FORWARDED_ALLOW_IPS", None)
    if allowed is not None:
        env["FORWARDED_ALLOW_IPS"] = allowed
    command = [sys.executable, "-m", "proxy", "serve", "--config", str(config)]
    command += ["--port", str(port), "--no-access-log"]
    server = subprocess.Popen(command, env=env, stderr=subprocess.PIPE)
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url, server)
        answer = httpx.post(
            base_url + "/dashboard/login",
            data={"key": ADMIN_KEY},
            headers={"x-forwarded-proto": "https"},
        )
    finally:
        server.terminate()
        server.communicate(timeout=30)
    assert answer.status_code == 303
    assert ("Secure" in answer.headers["set-cookie"]) is secure


def test_serve_refuses_a_tokenizer_it_cannot_load_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway started, then its app's startup failed with a two-part traceback from
    uvicorn's log and exit status 3; a broken policy is one line and status 1."""
    missing = tmp_path / "no-such-tokenizer.json"
    config = tmp_path / "policy.yaml"
    config.write_text(
        policy_text("http://127.0.0.1:9").replace(
            "  mock-small: {}", f'  mock-small: {{tokenizer: "{missing}"}}'
        )
    )
    monkeypatch.setenv("BACKEND_KEY", BACKEND_KEY)
    monkeypatch.setenv("BETA_KEY", BETA_KEY)
    done = tokenweir("serve", "--config", str(config), "--port", str(free_port()))
    assert done.returncode == 1, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith(f"tokenweir: the policy cannot be used: {config}: ")
    assert f"model 'mock-small': tokenizer '{missing}'" in lines[0]
    assert f"no such file or directory: {missing}" in lines[0]


def test_serve_refuses_a_broken_policy_readably(tmp_path: Path) -> None:
    config = tmp_path / "policy.yaml"
    config.write_text(policy_text("http://127.0.0.1:9"))
    done = tokenweir("serve", "--config", str(config), "--port", str(free_port()))
    assert done.returncode == 1
    assert "backends[0].api_key: environment variable BACKEND_KEY is not set" in done.stderr


def test_policy_check_and_serve_refuse_a_file_not_in_utf8_or_an_alias_bomb(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`policy check` printed a UnicodeDecodeError (or RecursionError) traceback, and `serve`
    started on the Latin-1 file with its é read as U+FFFD; an alias bomb never finished."""
    monkeypatch.setenv("BACKEND_KEY", BACKEND_KEY)
    monkeypatch.setenv("BETA_KEY", BETA_KEY)
    good = policy_text("http://127.0.0.1:9")
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(good.replace("  beta:", "  # équipe\n  beta:").encode("latin-1"))
    line = good.splitlines().index("  beta:") + 1
    loop = tmp_path / "loop.yaml"
    loop.write_text("x: &loop [*loop]\n" + good)
    bomb = tmp_path / "bomb.yaml"
    levels = [f"a{n}: &a{n} [{', '.join([f'*a{n - 1}'] * 9)}]" for n in range(1, 9)]
    bomb.write_text("a0: &a0 [x, x, x, x, x, x, x, x, x]\n" + "\n".join(levels) + "\n" + good)
    for config, message in [
        (latin1, f"{latin1}:{line}: byte 0xe9 is not UTF-8: save the file as UTF-8"),
        (loop, f"{loop}:1: x[0]"),
        (bomb, f"{bomb}:6: a5: aliases here repeat more values than the file holds"),
    ]:
        for command in [("policy", "check"), ("serve", "--port", str(free_port()), "--config")]:
            done = tokenweir(*command, str(config), timeout_s=120)
            assert done.returncode == 1, done.stderr[-2000:]
            assert message in done.stderr
            assert "Traceback" not in done.stderr


def test_serve_refuses_a_price_of_inf_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`policy check` said ok, then serve's startup failed with an OverflowError traceback."""
    monkeypatch.setenv("BACKEND_KEY", BACKEND_KEY)
    monkeypatch.setenv("BETA_KEY", BETA_KEY)
    config = tmp_path / "policy.yaml"
    config.write_text(
        policy_text("http://127.0.0.1:9").replace("input_per_1m: 0.1", "input_per_1m: .inf")
    )
    expected = f"{config}:12: models.mock-llm.price.input_per_1m: Input should be less than"
    for command in [("policy", "check"), ("serve", "--port", str(free_port()), "--config")]:
        done = tokenweir(*command, str(config))
        assert done.returncode == 1, done.stderr[-2000:]
        assert expected in done.stderr
        assert "Traceback" not in done.stderr


def test_a_backend_key_past_ascii_is_refused_before_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend key with a pasted non-breaking space passed `policy check` and `serve`
    started; then every request was a 500 `internal_error` and /readyz a 500 (the key cannot
    be written in a header). Both refuse it, naming the line and never the key."""
    monkeypatch.setenv("BACKEND_KEY", "backend\u00a0secret")
    monkeypatch.setenv("BETA_KEY", BETA_KEY)
    config = tmp_path / "policy.yaml"
    config.write_text(policy_text("http://127.0.0.1:9"))
    for command in [("policy", "check"), ("serve", "--port", str(free_port()), "--config")]:
        done = tokenweir(*command, str(config))
        assert done.returncode == 1, done.stderr[-2000:]
        assert "Traceback" not in done.stderr
        assert f"{config}:9: backends[0].api_key: the key holds U+00A0" in done.stderr
        assert "backend\u00a0secret" not in done.stderr


def test_serve_refuses_a_key_variable_that_ends_with_a_newline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key from a Kubernetes Secret made with `echo` ends with a newline: serve started,
    then every request was a 502 `LocalProtocolError` (the backend's key cannot go in a
    header) or a 401 (no client can send the tenant's key). It is refused, naming the line."""
    monkeypatch.setenv("BACKEND_KEY", BACKEND_KEY + "\n")
    monkeypatch.setenv("BETA_KEY", BETA_KEY + "\n")
    config = tmp_path / "policy.yaml"
    config.write_text(policy_text("http://127.0.0.1:9"))
    done = tokenweir("serve", "--config", str(config), "--port", str(free_port()))
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    for where, name in [
        (":9: backends[0].api_key", "BACKEND_KEY"),
        (":20: tenants.beta", "BETA_KEY"),
    ]:
        assert f"{config}{where}" in done.stderr
        assert f"environment variable {name} ends with a newline" in done.stderr
