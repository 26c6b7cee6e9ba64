"""The image starts on its defaults, serves the API against the mock backend in a second
container, follows its configured port in the health check, and drains streams on `docker stop`."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.deploy.conftest import build
from tests.deploy.engine import (
    EVERY_INTERFACE,
    REPO_ROOT,
    container,
    docker,
    host_url,
    inspect,
    network,
    unique,
    wait_healthy,
)

pytestmark = pytest.mark.engine

KEY = "tw-test-key"
DATA_DIR = "/var/lib/tokenweir"
POLICY = "/etc/tokenweir/policy.yaml"
CHAT = {"model": "mock-llm", "messages": [{"role": "user", "content": "hello"}]}


def test_image_is_non_root_with_a_data_volume_and_carries_its_licence(image: str) -> None:
    config = inspect(image)["Config"]
    assert isinstance(config, dict)
    assert config["User"] == "10001:10001"
    assert list(config["Volumes"]) == ["/var/lib/tokenweir"]
    assert config["WorkingDir"] == "/var/lib/tokenweir"
    assert "TOKENWEIR_LEDGER=sqlite:////var/lib/tokenweir/tokenweir.db" in config["Env"]
    owner = docker("run", "--rm", "--entrypoint", "stat", image, "-c", "%u %g %a", DATA_DIR)
    assert owner == "10001 0 770"  # group 0: an arbitrary UID in group 0 writes it too
    licence = docker(
        "run", "--rm", "--entrypoint", "python", image, "-c",
        "import importlib.metadata as m; d = m.distribution('tokenweir');"
        "print(next(f.read_text() for f in d.files if f.name == 'LICENSE'))",
    )  # fmt: skip
    assert licence == (REPO_ROOT / "LICENSE").read_text().strip()
    size_mb = int(inspect(image)["Size"]) / 1e6  # type: ignore[call-overload]
    print(f"\nimage {image}: {size_mb:.0f} MB")
    assert size_mb < 700


def test_image_serves_chat_stream_and_metrics_against_the_mock_in_a_second_container(
    image: str,
) -> None:
    with network() as net:
        # The mock on a port of its own: its health check must follow it.
        with (
            container(image, "mock-backend", "--host", EVERY_INTERFACE, "--port", "8001",
                      options=["--network", net, "--network-alias", "mock"]) as mock,
            container(image, options=[
                "--network", net, "-p", "127.0.0.1::8080", "-e", f"TOKENWEIR_API_KEY={KEY}",
                "-e", "TOKENWEIR_BACKEND_URL=http://mock:8001/v1",
            ]) as gateway,
        ):  # fmt: skip
            wait_healthy(mock)
            wait_healthy(gateway)
            url = host_url(gateway, 8080)
            client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
            with client:
                answer = client.chat.completions.create(**CHAT, max_tokens=8)
                chunks = list(client.chat.completions.create(**CHAT, max_tokens=8, stream=True))
            assert answer.usage is not None
            assert answer.usage.completion_tokens == 8
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text
            assert chunks[-1].choices[0].finish_reason == "length"
            metrics = httpx.get(url + "/metrics").text
            assert 'tenant="default"' in metrics
            assert httpx.get(url + "/readyz").json()["backends"] == {"local": "ok"}
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_health_check_follows_a_port_written_with_equals_and_under_an_init_process(
    image: str,
) -> None:
    """`serve --port=9100` is the same command as `serve --port 9100` to tokenweir; the health
    check used to miss the first form and asked 8080, so the container was marked unhealthy
    (and restarted by an orchestrator) while serving."""
    env = ["-e", f"TOKENWEIR_API_KEY={KEY}"]
    serve = ["serve", "--host", EVERY_INTERFACE, "--config", POLICY]
    with (
        container(image, *serve, "--port=9100", options=env) as equals,
        container(image, *serve, "--port", "9200", options=["--init", *env]) as under_init,
    ):
        wait_healthy(equals)
        wait_healthy(under_init)


def test_image_serves_and_bills_as_an_arbitrary_uid_in_group_zero(image: str) -> None:
    """OpenShift runs an image as a random UID in group 0. The data directory was the image
    user's alone (0750): such a container failed at startup, its ledger not writable."""
    options = ["--user", "12345:0", "-p", "127.0.0.1::8080"]
    with network() as net:
        with (
            container(image, "mock-backend", "--host", EVERY_INTERFACE,
                      options=["--network", net, "--network-alias", "mock", *options[:2]]),
            container(image, options=[
                "--network", net, *options, "-e", f"TOKENWEIR_API_KEY={KEY}",
                "-e", "TOKENWEIR_BACKEND_URL=http://mock:8000/v1",
            ]) as gateway,
        ):  # fmt: skip
            wait_healthy(gateway)
            client = openai.OpenAI(base_url=host_url(gateway, 8080) + "/v1", api_key=KEY)
            with client:
                client.chat.completions.create(**CHAT, max_tokens=4)
            docker("stop", gateway, timeout_s=60)  # the ledger is flushed on the way out
            assert inspect(gateway)["State"]["ExitCode"] == 0  # type: ignore[index]
            home = docker("run", "--rm", *options[:2], "--entrypoint", "sh", image, "-c",
                          "echo $HOME && touch $HOME/.probe")  # fmt: skip
            assert home == DATA_DIR  # a writable HOME (Hugging Face's cache), not /
            report = docker(
                "run", "--rm", *options[:2], "--volumes-from", gateway,
                "-e", f"TOKENWEIR_API_KEY={KEY}", image, "report", "--format", "json",
            )  # fmt: skip
    (row,) = json.loads(report)["rows"]
    assert row["requests"] == 1


def test_image_without_a_key_exits_saying_which_variable_is_missing(image: str) -> None:
    done = subprocess.run(
        ["docker", "run", "--rm", image], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 1
    assert "TOKENWEIR_API_KEY is not set or empty" in done.stderr


def _stream(url: str, seen_first: threading.Event, ends: list[str]) -> None:
    """One slow stream; records how it ended: "done", "error:<code>" or the exception."""
    body = {**CHAT, "max_tokens": 4000, "stream": True}
    try:
        with httpx.stream(
            "POST", url + "/v1/chat/completions", json=body,
            headers={"authorization": f"Bearer {KEY}"}, timeout=60,
        ) as answer:  # fmt: skip
            last = ""
            for line in answer.iter_lines():
                if line.startswith("data: "):
                    last = line.removeprefix("data: ")
                    seen_first.set()
        if last == "[DONE]":
            ends.append("done")
        else:
            ends.append("error:" + json.loads(last)["error"]["code"])
    except httpx.HTTPError as exc:
        seen_first.set()
        ends.append(f"broken: {exc!r}")


def test_docker_stop_ends_ten_open_streams_cleanly_and_every_one_reaches_the_ledger(
    image: str, tmp_path: Path
) -> None:
    ledger = unique("tw-test-ledger")
    env = ["-e", f"TOKENWEIR_API_KEY={KEY}", "-e", "TOKENWEIR_BACKEND_URL=http://mock:8000/v1"]
    serve = ["serve", "--host", EVERY_INTERFACE, "--port", "9000", "--config", POLICY]
    try:
        with (
            network() as net,
            container(image, "mock-backend", "--host", EVERY_INTERFACE, "--tokens-per-second", "20",
                      options=["--network", net, "--network-alias", "mock"]),
            container(image, *serve, options=[
                "--network", net, "-p", "127.0.0.1::9000", "-v", f"{ledger}:/var/lib/tokenweir",
                *env,
            ]) as gateway,
        ):  # fmt: skip
            wait_healthy(gateway)  # on --port 9000: the health check follows the port
            url = host_url(gateway, 9000)
            ends: list[str] = []
            firsts = [threading.Event() for _ in range(10)]
            clients = [threading.Thread(target=_stream, args=(url, f, ends)) for f in firsts]
            for client in clients:
                client.start()
            for first in firsts:
                assert first.wait(60), "a stream never started"
            started = time.monotonic()
            docker("stop", gateway, timeout_s=60)  # the engine's default: SIGTERM, 10 s, SIGKILL
            stopped_s = time.monotonic() - started
            for client in clients:
                client.join(60)
            state = inspect(gateway)["State"]
        assert isinstance(state, dict)
        assert state["ExitCode"] == 0, docker("logs", gateway, check=False)
        assert stopped_s < 10  # it exited by itself, before the engine's SIGKILL
        assert sorted(ends) == ["error:server_shutting_down"] * 10
        report = docker(
            "run", "--rm", "-v", f"{ledger}:/var/lib/tokenweir", *env, image,
            "report", "--format", "json",
        )  # fmt: skip
        (row,) = json.loads(report)["rows"]
        assert row["tenant"] == "default"
        assert row["requests"] == 10
        assert row["output_tokens"] >= 10
    finally:
        docker("volume", "rm", "-f", ledger, check=False)


def test_extras_build_argument_installs_otel_and_the_local_embedder(
    image: str, tmp_path: Path
) -> None:
    tag = image + "-extras"  # kept, so the next run finds its layers cached
    print(f"\nbuilt {tag} in {build(tag, '--build-arg', 'EXTRAS=otel,local-embed'):.0f} s")
    # A semantic cache on the local embedder, and traces exported: both need the extras.
    policy = (REPO_ROOT / "policies" / "default.yaml").read_text()
    policy = policy.replace("tenants:", "embedder: {local: all-MiniLM-L6-v2}\ntenants:")
    policy += "    cache: {mode: semantic}\n"
    (tmp_path / "policy.yaml").write_text(policy)
    tmp_path.chmod(0o755)
    (tmp_path / "policy.yaml").chmod(0o644)
    options = [
        "-e", f"TOKENWEIR_API_KEY={KEY}", "-e", "OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318",
        "-v", f"{tmp_path}:/etc/tokenweir:ro",
    ]  # fmt: skip
    with container(tag, options=options) as gateway:
        wait_healthy(gateway)
        logs = docker("logs", gateway)
    assert "pip install" not in logs
