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
from tests.shared import tokenizer_file

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
    qwen = tokenizer_file("qwen2.5/qwen.tiktoken")
    config = tmp_path_factory.mktemp("fuzz") / "policy.yaml"
    config.write_text(f"""
admin_keys: [{hash_key(ADMIN)}]
ledger: sqlite:///{config.parent / "ledger.db"}
server: {{max_body_bytes: 64KiB, body_timeout: 5s}}
upstream: {{probe_interval: 0s}}
backends: [{{name: mock, url: "{backend_url}/v1", models: [mock-llm, mock-embed, qwen]}}]
models: {{mock-llm: {{}}, mock-embed: {{}}, qwen: {{tokenizer: "{qwen}"}}}}
tenants:
  app:
    api_keys: [{hash_key(KEY)}]
    models: [mock-llm, mock-embed, qwen]
    budget: {{max_output_tokens: 4, tokens_per_day: 1000000000, history_limit: 3,
              system_prompt: "Be brief.", max_input_tokens: 20000, on_input_overflow: trim}}
    cache: {{mode: exact}}
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


# The request schema, valid and near-valid: every field OpenAI defines, each either a valid value
# or anything at all (wrong types, numbers past every range, 240-300 levels deep, odd unicode).
_unicode = st.text(
    alphabet=st.characters(exclude_categories=["Cs"]), max_size=30
) | st.sampled_from(
    ["<|im_start|>system\n", "<|endoftext|>", "<|eot_id|>", "\u202e\u0000", "😀" * 20]
)
_deep_value = st.integers(240, 300).map(lambda depth: _nest(depth))
_huge = st.sampled_from([1e300, -1e300, 1e20, 2**63, 2**64 - 1, -(2**63) - 1, -1, 0, 0.5, True])
_anything = _json | _huge | _deep_value | _unicode


def _nest(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


def _or_anything(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return valid | _anything


_part = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, _or_anything(_unicode)),
    st.just({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}),
    _anything,
)
_call = st.fixed_dictionaries(
    {
        "id": _or_anything(st.just("call_1")),
        "type": st.just("function"),
        "function": _or_anything(
            st.fixed_dictionaries(
                {"name": _or_anything(st.just("f")), "arguments": _or_anything(st.just('{"a": 1}'))}
            )
        ),
    }
)
_message = st.fixed_dictionaries(
    {
        "role": _or_anything(st.sampled_from(["system", "developer", "user", "assistant", "tool"])),
        "content": _or_anything(_unicode | st.lists(_part, max_size=3) | st.none()),
    },
    optional={
        "name": _or_anything(st.just("bob")),
        "tool_calls": _or_anything(st.lists(_call, max_size=2)),
        "tool_call_id": _or_anything(st.just("call_1")),
        "x-extension": _anything,
    },
)
_tool = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": _or_anything(
            st.fixed_dictionaries(
                {
                    "name": _or_anything(st.just("lookup")),
                    "parameters": _or_anything(
                        st.just(
                            {
                                "type": "object",
                                "properties": {"q": {"type": "string", "enum": ["a", "b"]}},
                            }
                        )
                    ),
                }
            )
        ),
    }
)
_prompt = st.one_of(
    _unicode,
    st.lists(_unicode, min_size=1, max_size=3),
    st.lists(st.integers(0, 50_000), min_size=1, max_size=5),
    st.lists(st.lists(st.integers(0, 50_000), min_size=1, max_size=3), min_size=1, max_size=2),
)
_sampling = {
    "stream": st.booleans(),
    "max_tokens": st.integers(1, 8),
    "n": st.integers(1, 2),
    "temperature": st.sampled_from([0, 0.5, 1.0]),
    "top_p": st.floats(0, 1),
    "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.floats(-2, 2),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": st.just(["\n"]) | _unicode,
    "logit_bias": st.just({"50256": -100}),
    "user": _unicode,
}
_chat_fields = {
    **_sampling,
    "max_completion_tokens": st.integers(1, 8),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 20),
    "tools": st.lists(_tool, max_size=2),
    "tool_choice": st.sampled_from(
        ["auto", "none", {"type": "function", "function": {"name": "lookup"}}]
    ),
    "functions": st.just([{"name": "f", "parameters": {}}]),
    "function_call": st.just("auto"),
    "response_format": st.just({"type": "json_object"}),
    "parallel_tool_calls": st.booleans(),
    "metadata": st.just({"k": "v"}),
    "stream_options": st.just({"include_usage": True}),
    "top_k": st.integers(1, 5),  # unknown to OpenAI: passes to the backend untouched
}
_completion_fields = {
    **_sampling,
    "logprobs": st.integers(0, 5),
    "echo": st.booleans(),
    "suffix": _unicode,
    "best_of": st.integers(1, 2),
}
_embedding_fields = {
    "dimensions": st.integers(1, 64),
    "user": _unicode,
    "encoding_format": st.sampled_from(["float", "base64"]),
}


def _request(
    path: str,
    models: list[str],
    required: dict[str, st.SearchStrategy[Any]],
    optional: dict[str, st.SearchStrategy[Any]],
) -> st.SearchStrategy[tuple[str, dict[str, Any]]]:
    fields = {name: _or_anything(value) for name, value in optional.items()}
    body = st.fixed_dictionaries(
        {"model": st.sampled_from(models), **{k: _or_anything(v) for k, v in required.items()}},
        optional=fields,
    )
    return body.map(lambda b: (path, b))


_requests = st.one_of(
    _request(
        "/v1/chat/completions",
        ["mock-llm", "qwen"],
        {"messages": st.lists(_message, min_size=1, max_size=5)},
        _chat_fields,
    ),
    _request("/v1/completions", ["mock-llm", "qwen"], {"prompt": _prompt}, _completion_fields),
    _request("/v1/embeddings", ["mock-embed"], {"input": _prompt}, _embedding_fields),
)


@settings(BUDGET, max_examples=150)
@given(request=_requests)
def test_the_request_schema_valid_or_near_valid_never_gets_a_5xx(
    gateway: tuple[str, int], request: tuple[str, dict[str, Any]]
) -> None:
    path, body = request
    headers = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}
    answer = _send(gateway[0], "POST", path, content=_dumps(body), headers=headers)
    assert answer.status_code < 500, answer.text
    assert_well_formed(answer)


def test_the_gateway_still_serves_after_the_fuzzing(gateway: tuple[str, int]) -> None:
    headers = {"authorization": f"Bearer {KEY}"}
    answer = _send(gateway[0], "POST", "/v1/chat/completions", json=_valid, headers=headers)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"]


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
