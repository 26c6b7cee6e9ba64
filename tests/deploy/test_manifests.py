"""examples/k8s and examples/compose checked without a cluster: every name they reference
exists, the probes are routes the gateway serves with the meaning the manifests need, and image,
user, ports and data directory agree with the Dockerfile. (Kubernetes is not started here.)"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from proxy.app import DEFAULT_POLICY, create_app
from proxy.policy import load_policy, parse_policy
from proxy.policy.model import Policy
from tests.deploy.engine import REPO_ROOT
from tests.servers import free_port, serve

K8S = REPO_ROOT / "examples" / "k8s"
COMPOSE = REPO_ROOT / "examples" / "compose"
ENV = {"DEMO_TENANT_KEY": "k1", "ADMIN_KEY": "k2", "TOKENWEIR_API_KEY": "k3"}


def _dockerfile() -> dict[str, str]:
    """The final stage's instructions, by name (the last of each wins, as in Docker)."""
    text = (REPO_ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    final = text[text.rindex("\nFROM ") :]
    return {m[1]: m[2].strip() for m in re.finditer(r"^([A-Z]+) (.*)$", final, re.MULTILINE)}


DOCKERFILE = _dockerfile()
PORT = int(DOCKERFILE["EXPOSE"])
UID = int(DOCKERFILE["USER"].split(":")[0])
(DATA_DIR,) = json.loads(DOCKERFILE["VOLUME"])
VERSION = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]


def _k8s() -> dict[tuple[str, str], dict[str, object]]:
    docs = [d for f in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    kinds = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert len(kinds) == len(docs), "two objects of one kind share a name"
    return kinds


KINDS = _k8s()
POD = KINDS[("Deployment", "tokenweir")]["spec"]["template"]  # type: ignore[index]
(GATEWAY,) = POD["spec"]["containers"]


def _k8s_policy() -> Policy:
    text = KINDS[("ConfigMap", "tokenweir-policy")]["data"]["policy.yaml"]  # type: ignore[index]
    return parse_policy(text, file="tokenweir-policy", environ=ENV)


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_k8s_image_command_user_port_and_data_dir_agree_with_the_dockerfile() -> None:
    assert GATEWAY["image"] == f"tokenweir:{VERSION}"
    assert GATEWAY["imagePullPolicy"] == "IfNotPresent"
    assert GATEWAY["args"] == json.loads(DOCKERFILE["CMD"])
    assert json.loads(DOCKERFILE["ENTRYPOINT"]) == ["tokenweir"]
    assert GATEWAY["args"][GATEWAY["args"].index("--port") + 1] == str(PORT)
    assert GATEWAY["ports"] == [{"containerPort": PORT, "name": "http"}]
    assert POD["spec"]["securityContext"]["runAsUser"] == UID
    assert POD["metadata"]["annotations"]["prometheus.io/port"] == str(PORT)
    volumes = {v["name"]: v for v in POD["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in GATEWAY["volumeMounts"]}
    assert "emptyDir" in volumes[mounts[DATA_DIR]]  # writable under a read-only root
    assert "emptyDir" in volumes[mounts["/tmp"]]  # noqa: S108 (the pod's own /tmp)
    config_dir = json.loads(DOCKERFILE["CMD"])[-1].rsplit("/", 1)[0]
    assert volumes[mounts[config_dir]]["configMap"]["name"] == "tokenweir-policy"


def test_k8s_pod_is_locked_down_and_sized() -> None:
    pod, container = POD["spec"]["securityContext"], GATEWAY["securityContext"]
    assert pod["runAsNonRoot"] is True
    assert pod["runAsUser"] != 0
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["readOnlyRootFilesystem"] is True
    assert container["allowPrivilegeEscalation"] is False
    assert container["capabilities"] == {"drop": ["ALL"]}
    assert set(GATEWAY["resources"]["requests"]) == {"cpu", "memory"}
    drain_s = _k8s_policy().server.drain_timeout
    assert POD["spec"]["terminationGracePeriodSeconds"] > 5 + drain_s + 5  # preStop + drain + flush


def test_k8s_every_reference_resolves() -> None:
    labels = POD["metadata"]["labels"]
    deployment = KINDS[("Deployment", "tokenweir")]["spec"]
    assert _matches(deployment["selector"]["matchLabels"], labels)  # type: ignore[index]
    for kind in ("Service", "PodDisruptionBudget"):
        spec = KINDS[(kind, "tokenweir")]["spec"]
        selector = spec["selector"]  # type: ignore[index]
        assert _matches(selector.get("matchLabels", selector), labels), kind
    target = KINDS[("HorizontalPodAutoscaler", "tokenweir")]["spec"]["scaleTargetRef"]  # type: ignore[index]
    assert (target["kind"], target["name"]) in KINDS
    assert KINDS[("Service", "tokenweir")]["spec"]["ports"][0]["targetPort"] == "http"  # type: ignore[index]
    volumes = {v["name"] for v in POD["spec"]["volumes"]}
    assert {m["name"] for m in GATEWAY["volumeMounts"]} <= volumes
    # Every secret key the pod reads is one the header's `kubectl create secret` makes, and
    # every ${NAME} of the policy is set in the pod.
    header = (K8S / "tokenweir.yaml").read_text().split("apiVersion", 1)[0]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in GATEWAY["env"]}
    for ref in env.values():
        assert ref["name"] == "tokenweir"
        assert f"--from-literal={ref['key']}=" in header
    text = KINDS[("ConfigMap", "tokenweir-policy")]["data"]["policy.yaml"]  # type: ignore[index]
    assert set(re.findall(r"\$\{(\w+)", text)) <= set(env)
    # The policy's storage and backends are Services of these manifests, on the right ports.
    policy = _k8s_policy()
    for url in (policy.storage, *(b.url for b in policy.backends)):
        host, port = urlsplit(url).hostname, urlsplit(url).port
        service = KINDS[("Service", str(host))]["spec"]
        assert port in [p["port"] for p in service["ports"]], url  # type: ignore[index]
    redis = KINDS[("StatefulSet", "redis")]["spec"]["template"]["spec"]  # type: ignore[index]
    claims = {v["persistentVolumeClaim"]["claimName"] for v in redis["volumes"]}
    assert claims <= {name for kind, name in KINDS if kind == "PersistentVolumeClaim"}
    assert "--appendonly" in redis["containers"][0]["args"]


def test_k8s_backend_service_is_marked_as_a_placeholder() -> None:
    (backend,) = _k8s_policy().backends
    name = str(urlsplit(backend.url).hostname)
    service = KINDS[("Service", name)]
    annotations = service["metadata"]["annotations"]  # type: ignore[index]
    assert annotations["tokenweir.example/placeholder"].startswith("replace with your")
    assert (K8S / "backend.yaml").read_text().startswith("# PLACEHOLDER")
    selector = service["spec"]["selector"]  # type: ignore[index]
    assert not any(
        _matches(selector, d["spec"]["template"]["metadata"]["labels"])  # type: ignore[index]
        for (kind, _), d in KINDS.items()
        if kind in ("Deployment", "StatefulSet")
    ), "the placeholder selects no workload of these manifests: the user brings the backend"


@pytest.fixture(scope="module")
def gateway_without_backend() -> str:
    """The gateway on the k8s policy's shape, its only backend a port nobody listens on."""
    policy = _k8s_policy()
    dead = policy.backends[0].model_copy(update={"url": f"http://127.0.0.1:{free_port()}/v1"})
    policy = policy.model_copy(update={"storage": "memory", "ledger": None, "backends": (dead,)})
    with serve(create_app(policy)) as url:
        yield url  # type: ignore[misc]


def test_k8s_readiness_is_gateway_can_serve_and_ignores_a_backend_outage(
    gateway_without_backend: str,
) -> None:
    ready = GATEWAY["readinessProbe"]["httpGet"]
    live = GATEWAY["livenessProbe"]["httpGet"]
    assert ready["port"] == live["port"] == "http"
    probe = httpx.get(gateway_without_backend + ready["path"])
    assert probe.status_code == 200, probe.text
    assert probe.json()["storage"] == "ok"
    assert httpx.get(gateway_without_backend + live["path"]).status_code == 200
    # /readyz itself keeps its contract: no backend answering, not ready.
    full = httpx.get(gateway_without_backend + "/readyz")
    assert full.status_code == 503
    assert full.json()["models_without_backend"] == ["qwen2.5-7b-instruct"]
    scrape = POD["metadata"]["annotations"]["prometheus.io/path"]
    assert httpx.get(gateway_without_backend + scrape).status_code == 200


def test_compose_example_discovers_replicas_at_request_time_and_streams_unbuffered() -> None:
    compose = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"redis", "backend", "vllm", "tokenweir", "lb"}
    assert services["tokenweir"]["deploy"]["replicas"] == 3
    nginx = (COMPOSE / "nginx.conf").read_text()
    config = re.sub(r"#.*", "", nginx)
    assert "resolver 127.0.0.11 valid=5s" in config
    # A name in an `upstream` block is resolved once, when nginx starts.
    assert re.search(r"^\s*upstream\s", config, re.MULTILINE) is None
    (variable,) = re.findall(r"proxy_pass (\$\w+);", config)
    assert f"set {variable} http://tokenweir:{PORT};" in config
    assert "proxy_buffering off;" in config
    assert "non_idempotent" not in config  # and the comment says POSTs are not retried
    assert "does not retry" in nginx
    read_timeout_s = int(re.findall(r"proxy_read_timeout (\d+)s;", config)[0])
    policy = load_policy(COMPOSE / "policy.yaml", environ=ENV)
    assert read_timeout_s > policy.upstream.read_timeout
    grace_s = int(services["tokenweir"]["stop_grace_period"].removesuffix("s"))
    assert grace_s > policy.server.drain_timeout
    assert (COMPOSE / ".env").read_text().count("COMPOSE_PROFILES=mock") == 1


def test_compose_vllm_profile_replaces_the_mock_under_the_same_name_with_a_gpu() -> None:
    services = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())["services"]
    mock, vllm = services["backend"], services["vllm"]
    assert mock["profiles"] == ["mock"]
    assert vllm["profiles"] == ["vllm"]
    assert vllm["networks"]["default"]["aliases"] == ["backend"]
    (device,) = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"]
    assert device["driver"] == "nvidia"
    policy = load_policy(COMPOSE / "policy.yaml", environ=ENV)
    (backend,) = policy.backends
    assert backend.url == "http://backend:8000/v1"
    assert "--port=8000" in vllm["command"]
    assert "8000" in mock["command"]
    served = next(a for a in vllm["command"] if a.startswith("--served-model-name="))
    assert served.split("=", 1)[1] in backend.models


def test_default_policy_reads_backend_keys_and_ledger_from_the_environment() -> None:
    assert (REPO_ROOT / "policies" / "default.yaml").read_bytes() == DEFAULT_POLICY.read_bytes()
    plain = load_policy(DEFAULT_POLICY, environ={"TOKENWEIR_API_KEY": "k"})
    assert plain.backends[0].url == "http://127.0.0.1:8000/v1"
    assert plain.backends[0].api_key is None  # ${TOKENWEIR_BACKEND_KEY:-}: no key is sent
    assert plain.ledger == "sqlite:///tokenweir.db"
    env = {
        "TOKENWEIR_API_KEY": "k", "TOKENWEIR_BACKEND_URL": "http://vllm:8000/v1/",
        "TOKENWEIR_BACKEND_KEY": "secret", "TOKENWEIR_LEDGER": "sqlite:////data/usage.db",
    }  # fmt: skip
    policy = load_policy(DEFAULT_POLICY, environ=env)
    (backend,) = policy.backends
    assert backend.url == "http://vllm:8000/v1"
    assert backend.api_key is not None
    assert backend.api_key.get_secret_value() == "secret"
    assert policy.ledger == "sqlite:////data/usage.db"
    assert "TOKENWEIR_LEDGER=sqlite:////var/lib/tokenweir/tokenweir.db" in DOCKERFILE["ENV"].split()


def test_a_required_variable_without_default_still_fails_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="TOKENWEIR_API_KEY is not set or empty"):
        load_policy(DEFAULT_POLICY, environ={"TOKENWEIR_API_KEY": ""})
    required = re.sub(
        r"\$\{TOKENWEIR_BACKEND_URL:-[^}]*\}",
        "${TOKENWEIR_BACKEND_URL}",
        DEFAULT_POLICY.read_text(),
    )
    with pytest.raises(ValueError, match="TOKENWEIR_BACKEND_URL is not set or empty"):
        parse_policy(required, environ={"TOKENWEIR_API_KEY": "k"})


def _bytes(quantity: str) -> int:
    """A Kubernetes memory quantity (`1Gi`, `512Mi`) or a Redis size (`640mb`), in bytes."""
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", quantity).groups()  # type: ignore[union-attr]
    scale = {"": 1, "ki": 2**10, "mi": 2**20, "gi": 2**30, "kb": 2**10, "mb": 2**20, "gb": 2**30}
    return int(number) * scale[unit.lower()]


def test_k8s_redis_refuses_writes_when_full_instead_of_being_oom_killed() -> None:
    """Under a container memory limit, Redis with no `maxmemory` grows until the kernel kills
    it; it then replays its append-only file, as large as before, and is killed again: every
    gateway loses its storage for good. A `maxmemory` below the limit, `noeviction` (the
    gateway's counters and ledger must never be evicted: docs/operations.md), is what lets a
    full Redis refuse writes and recover."""
    (redis,) = KINDS[("StatefulSet", "redis")]["spec"]["template"]["spec"]["containers"]  # type: ignore[index]
    args = redis["args"]
    assert "--maxmemory" in args, "no maxmemory under a memory limit: OOM-killed when full"
    limit = _bytes(redis["resources"]["limits"]["memory"])
    assert _bytes(args[args.index("--maxmemory") + 1]) <= limit * 0.75  # room for the rewrite
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"


def test_compose_services_of_the_image_that_serve_nothing_have_no_health_check() -> None:
    """The image's HEALTHCHECK asks PID 1's gateway (or mock) port. A service of the image that
    runs something else (the Grafana example's `traffic` loop) answered no port and showed
    `unhealthy` for as long as it ran."""
    for compose in (COMPOSE, REPO_ROOT / "examples" / "grafana"):
        services = yaml.safe_load((compose / "docker-compose.yml").read_text())["services"]
        for name, service in services.items():
            if "build" not in service:
                continue  # not this image
            command = [*service.get("entrypoint", ["tokenweir"]), *service.get("command", [])]
            serves = command[:1] == ["tokenweir"] and (
                command[1:2] in ([], ["serve"], ["mock-backend"])
            )
            if not serves:
                assert service.get("healthcheck") == {"disable": True}, f"{compose.name}: {name}"
