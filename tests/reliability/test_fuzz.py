"""Bad input against a real `tokenweir serve`: random bodies, headers and query strings.

Every answer is a success or a well-formed OpenAI error (never a 500, never a hang), and the
gateway's memory stays flat. CI runs a fixed, derandomized budget of examples."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.policy.units import hash_key
from tests.servers import replicas

KEY = "tw-fuzz"
ADMIN = "tw-fuzz-admin"
BUDGET = settings(
    max_examples=200,
    derandomize=True,
    database=None,  # no .hypothesis/ directory: CI replays the same examples anyway
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
POSTS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
GETS = ["/v1/models", "/api/usage", "/healthz", "/dashboard", "/dashboard/tenants/app"]

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=50)
)
_json = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5)
    ),
    max_leaves=30,
)
_fields = ["model", "messages", "prompt", "input", "stream", "max_tokens", "temperature", "n",
           "stream_options", "stop", "tools", "max_completion_tokens", "user"]  # fmt: skip
_valid = {
    "model": "mock-llm",
    "messages": [{"role": "user", "content": "hi"}],
    "prompt": "hi",
    "input": "hi",
    "max_tokens": 3,
}


def _dumps(value: object) -> bytes:
    """JSON as a client may send it: integers beyond 64 bits included (orjson refuses those)."""
    return json.dumps(value).encode()


def _deep(depth: int) -> bytes:
    return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"


_bodies = st.one_of(
    st.binary(max_size=300),
    _json.map(_dumps),
    # A valid request with one field replaced by anything: reaches the deeper stages.
    st.builds(lambda k, v: _dumps({**_valid, k: v}), st.sampled_from(_fields), _json),
    st.sampled_from([_deep(10_000), b'{"max_tokens": 1e400}', b'{"n": 99999999999999999999999}',
                     b'{"model": "\\ud800"}', b"\xff\xfe{", b'{"model": "mock-llm"' * 500]),
)  # fmt: skip
_header_names = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=20
).filter(lambda n: n not in {"content-length", "transfer-encoding", "host", "connection"})
_header_values = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"),
    max_size=80,
).map(lambda v: v.strip().encode("latin-1"))  # raw bytes: obs-text included
_headers = st.dictionaries(_header_names, _header_values, max_size=6)
_auth = st.sampled_from([f"Bearer {KEY}", f"Bearer {ADMIN}", "Bearer wrong", "", "Basic eA==",
                         "Bearer " + "x" * 5000])  # fmt: skip
_query = st.lists(st.tuples(st.text(max_size=12), st.text(max_size=30)), max_size=5)


@pytest.fixture(scope="module")
def gateway(
    backend_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, int]]:
    config = tmp_path_factory.mktemp("fuzz") / "policy.yaml"
    config.write_text(f"""
admin_keys: [{hash_key(ADMIN)}]
ledger: sqlite:///{config.parent / "ledger.db"}
server: {{max_body_bytes: 64KiB, body_timeout: 5s}}
backends: [{{name: mock, url: "{backend_url}/v1", models: [mock-llm, mock-embed]}}]
models: {{mock-llm: {{}}, mock-embed: {{}}}}
tenants:
  app:
    api_keys: [{hash_key(KEY)}]
    models: [mock-llm, mock-embed]
    budget: {{max_output_tokens: 4}}
""")  # fmt: skip
    with replicas(config, 1) as [(process, url)]:
        yield url, process.pid


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def assert_well_formed(answer: httpx.Response) -> None:
    """A success, or OpenAI's error shape with a status OpenAI would use; never a 500."""
    assert answer.status_code != 500, answer.text
    assert answer.status_code < 600
    assert answer.headers.get("x-request-id")
    if answer.status_code < 400:
        return
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str)
    assert error["message"]
    assert isinstance(error["type"], str)


def _send(url: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=10) as http:  # a hang fails as a timeout
        return http.request(method, path, **kwargs)


@BUDGET
@given(path=st.sampled_from(POSTS), body=_bodies, auth=_auth)
def test_random_bodies_get_an_answer_or_an_openai_error(
    gateway: tuple[str, int], path: str, body: bytes, auth: str
) -> None:
    headers = {"content-type": "application/json", "authorization": auth}
    assert_well_formed(_send(gateway[0], "POST", path, content=body, headers=headers))


@BUDGET
@given(path=st.sampled_from(POSTS + GETS), headers=_headers, auth=_auth, query=_query)
def test_random_headers_and_query_strings_get_an_answer_or_an_openai_error(
    gateway: tuple[str, int], path: str, headers: dict[str, bytes], auth: str,
    query: list[tuple[str, str]],
) -> None:  # fmt: skip
    method = "POST" if path in POSTS else "GET"
    body = orjson.dumps(_valid) if method == "POST" else None
    answer = _send(gateway[0], method, path, params=query, content=body,
                   headers={**headers, "authorization": auth})  # fmt: skip
    if path.startswith("/dashboard"):  # pages for people: errors are HTML pages, never a 500
        assert answer.status_code < 500, answer.text
        assert answer.headers["content-type"].startswith("text/html")
        return
    assert_well_formed(answer)


def test_memory_stays_flat_under_bad_input(gateway: tuple[str, int]) -> None:
    url, pid = gateway
    junk = [b"\xff" * 1000, _deep(5000), _dumps({"model": "x" * 60_000}), b"{" * 20_000]
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}

    def round_of_junk(http: httpx.Client) -> None:
        for i in range(200):
            body = junk[i % len(junk)]
            assert_well_formed(http.post(POSTS[i % len(POSTS)], content=body, headers=headers))

    with httpx.Client(base_url=url, timeout=10) as http:
        round_of_junk(http)  # warm up: caches, pools and allocator arenas reach their size
        before = _rss_bytes(pid)
        for _ in range(4):
            round_of_junk(http)
    grown = _rss_bytes(pid) - before
    assert grown < 8 * 1024 * 1024, f"the gateway grew {grown / 2**20:.1f} MiB over 800 requests"
