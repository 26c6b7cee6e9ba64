"""Integers past 64 bits through the exact cache, which orjson reads as the nearest float: two
requests whose field (one the gateway passes through: `vllm_xargs`, a client's own) differs past
a float's precision are two questions, and a replayed answer carries the backend's big integer
as it wrote it. A real gateway, the openai SDK and a backend on 127.0.0.1 that answers with the
request's field in its usage (Python's JSON keeps it exact)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from starlette.types import Receive, Scope, Send

from proxy.app import create_app
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from tests.servers import serve
from tests.web.lyingbackend import read_body, send_whole

KEY = "tw-test-cache-exact-ints"
REF = 2**70  # 1180591620717411303424, read by orjson as 1.1805916207174113e+21
NEIGHBOUR = REF + 1  # the same float


async def echo_ref(scope: Scope, receive: Receive, send: Send) -> None:
    """Chat answers whose usage says the request's `ref`, whole or streamed."""
    if scope["type"] != "http":
        return
    request = json.loads(await read_body(receive))
    usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
    usage["ref_seen"] = request.get("ref")
    text = f"ref {request.get('ref')}"
    head = {"id": "c1", "model": "m", "created": 1}
    if not request.get("stream"):
        choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        answer = {**head, "object": "chat.completion", "usage": usage}
        answer["choices"] = [{**choice, "finish_reason": "stop"}]
        await send_whole(send, 200, json.dumps(answer).encode(), b"application/json")
        return
    chunk = {**head, "object": "chat.completion.chunk"}
    events = [
        {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": text}}]},
        {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {**chunk, "choices": [], "usage": usage},
    ]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    await send_whole(send, 200, body + b"data: [DONE]\n\n", b"text/event-stream")


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    with serve(echo_ref) as backend:
        policy = f"""
storage: memory
backends: [{{name: b, url: "{backend}/v1", models: [m]}}]
models: {{m: {{}}}}
tenants:
  t: {{api_keys: [{hash_key(KEY)}], models: [m], cache: {{mode: exact}}}}
"""
        with serve(create_app(parse_policy(policy, environ={}))) as url:
            yield url


def ask(url: str, ref: int, question: str, **fields: object) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": question}], "ref": ref}
    body["temperature"] = 0
    headers = {"authorization": f"Bearer {KEY}"}
    return httpx.post(url + "/v1/chat/completions", json={**body, **fields}, headers=headers)


def test_fields_one_float_apart_are_two_questions(gateway: str) -> None:
    first = ask(gateway, REF, "Which ref?")
    second = ask(gateway, NEIGHBOUR, "Which ref?")
    assert first.headers["x-tokenweir-cache"] == "miss"
    assert second.headers["x-tokenweir-cache"] == "miss"
    assert second.json()["choices"][0]["message"]["content"] == f"ref {NEIGHBOUR}"
    again = ask(gateway, NEIGHBOUR, "Which ref?")
    assert again.headers["x-tokenweir-cache"] == "hit"
    assert again.json()["choices"][0]["message"]["content"] == f"ref {NEIGHBOUR}"


@pytest.mark.parametrize("first_stream", [False, True])
def test_a_replay_carries_the_backends_big_integer_as_written(
    gateway: str, first_stream: bool
) -> None:
    """Stored from a whole answer or a stream, replayed as both: `ref_seen` stays exact."""
    question = f"Ref, first streamed: {first_stream}?"
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    first = ask(gateway, NEIGHBOUR, question, **(stream if first_stream else {}))
    assert first.headers["x-tokenweir-cache"] == "miss"
    whole = ask(gateway, NEIGHBOUR, question)
    assert whole.headers["x-tokenweir-cache"] == "hit"
    assert f'"ref_seen":{NEIGHBOUR}'.encode() in whole.content
    client = openai.OpenAI(base_url=gateway + "/v1", api_key=KEY, max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": question}],
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ref": NEIGHBOUR},
        )
    )
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.model_extra == {"ref_seen": NEIGHBOUR}
    assert usage.completion_tokens == 1
