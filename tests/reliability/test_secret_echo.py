"""A backend that quotes the gateway's key back in its error answers: the key reaches no client,
no log line, no ledger record and no span, through a real `tokenweir serve`."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import openai
import orjson
from starlette.types import Receive, Scope, Send

from proxy.policy.units import hash_key
from tests.servers import free_port, serve, wait_healthy
from tests.telemetry.collector import collector

TENANT_KEY = "tw-echo-tenant-key-7a8b9c"
BACKEND_KEY = "sk-echoed-backend-key-3d4e5f"
STATUSES = (400, 404, 422, 429, 500, 503)


async def quoting_backend(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers each call with the status its prompt names, quoting its Authorization header in
    the error's message, param and code (a 500 in plain text)."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    status = int(orjson.loads(body)["messages"][0]["content"])
    said = dict(scope["headers"]).get(b"authorization", b"").decode()
    if status == 500:
        out = f"handler failed for Authorization: {said}".encode()
    else:
        fields = {"message": f"the key {said} may not", "param": said, "code": said}
        out = orjson.dumps({"error": {**fields, "type": "invalid_request_error"}})
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(out))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": out})


def _policy(tmp_path: Path, backend_url: str) -> Path:
    config = tmp_path / "policy.yaml"
    config.write_text(f"""
ledger: sqlite:///{tmp_path / "ledger.db"}
backends: [{{name: quoting, url: "{backend_url}/v1", api_key: "${{ECHO_BACKEND_KEY}}",
            models: [mock-llm]}}]
models: {{mock-llm: {{}}}}
tenants: {{app: {{api_keys: [{hash_key(TENANT_KEY)}], models: [mock-llm]}}}}
""")  # fmt: skip
    return config


def _errors(url: str) -> list[str]:
    """What the openai SDK's caller is shown of each refused request."""
    seen = []
    with openai.OpenAI(base_url=url + "/v1", api_key=TENANT_KEY, max_retries=0) as client:
        for status in STATUSES:
            try:
                client.chat.completions.create(
                    model="mock-llm", messages=[{"role": "user", "content": str(status)}]
                )
            except openai.APIStatusError as exc:
                seen.append(f"{exc.status_code} {exc} {exc.body} {exc.response.headers}")
    return seen


def test_a_backend_quoting_the_gateways_key_in_its_errors_shows_it_to_no_one(
    tmp_path: Path,
) -> None:
    """Its message, param and code went to the client as they were (a 5xx's text in the
    gateway's own message), and the code into the access log, the ledger and the spans."""
    with serve(quoting_backend) as backend_url, collector() as traces:
        port = free_port()
        command = [sys.executable, "-m", "proxy", "serve", "--port", str(port)]
        command += ["--config", str(_policy(tmp_path, backend_url)), "--log-level", "debug"]
        env = {
            **os.environ, "ECHO_BACKEND_KEY": BACKEND_KEY,
            "OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{traces.server_port}",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }  # fmt: skip
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, process)
            errors = _errors(url)
        finally:
            process.terminate()
            stdout, stderr = process.communicate(timeout=60)
        spans = b"".join(request.SerializeToString() for _, request in traces.spans())
    assert len(errors) == len(STATUSES), errors
    assert "may not" in errors[0]  # the backend's own message, all but the key
    with sqlite3.connect(tmp_path / "ledger.db") as ledger:
        records = "\n".join(ledger.iterdump())  # every table: records and aggregates
    assert records.count('INSERT INTO "usage_records"') >= len(STATUSES)
    assert b"quoting" in spans  # the backend calls' spans were exported
    for text in [*errors, stdout.decode(), stderr.decode(), records, spans.decode("latin-1")]:
        assert BACKEND_KEY not in text
