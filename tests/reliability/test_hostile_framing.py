"""A real `tokenweir serve`, two tenants, one hostile backend (tests/upstream/hostile.py) that
breaks HTTP/1.1's framing on tenant A's requests: A gets its answer or an OpenAI-shaped 502, the
gateway's memory stays bounded, and tenant B's next request gets its own answer, never A's."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import orjson
import pytest

from proxy.policy.units import hash_key
from tests.reliability.test_hostile_backend import (
    RSS_BOUND_BYTES,
    Gateway,
    PeakRss,
    assert_openai_error,
    refused,
)
from tests.servers import replicas
from tests.upstream import hostile
from tests.upstream.hostile import CHAT, CHUNK, HostileBackend, Misbehaviour, Writer, event

MODEL = "hostile-llm"
MESSAGES: list[Any] = [{"role": "user", "content": "hello"}]
SECRET = orjson.dumps({**CHAT, "choices": [{**CHAT["choices"][0], "message": {"content": "A's"}}]})
SECRET_ANSWER = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(SECRET), SECRET)
FINE = orjson.dumps(CHAT)
FINE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
SENT_LATER = threading.Event()  # idle_then_answer: the test says when


def _chunked(body: bytes, end: bytes = b"0\r\n\r\n", head: bytes = FINE_HEAD) -> bytes:
    head += b"transfer-encoding: chunked\r\n\r\n"
    return head + b"%x\r\n%b\r\n" % (len(body), body) + end


def _raw(data: bytes) -> Misbehaviour:
    async def answer(server: HostileBackend, writer: Writer, request: dict[str, Any]) -> None:
        await server.send(str(request["hostile"]), writer, data)

    return answer


def _trailer_flood(line: bytes, first: bytes = b"") -> Misbehaviour:
    """The answer, its last chunk, then trailers (`first`, then `line` again and again): the
    gateway kept them all until the total deadline."""

    async def answer(server: HostileBackend, writer: Writer, request: dict[str, Any]) -> None:
        name = str(request["hostile"])
        end = b"0\r\n" + first
        if request.get("stream"):
            await server.send(name, writer, _chunked(event(CHUNK), end, STREAM_HEAD))
        else:
            await server.send(name, writer, _chunked(FINE, end))
        await asyncio.sleep(0.1)  # the head in a read of its own, as a real backend's comes
        await server.endless(name, writer, line * 1024)

    return answer


async def _idle_then_answer(server: HostileBackend, writer: Writer, request: Any) -> None:
    await server.send(
        "idle_then_answer", writer, FINE_HEAD + b"content-length: %d\r\n\r\n" % len(FINE) + FINE
    )
    await asyncio.to_thread(SENT_LATER.wait, 10)
    await server.send("idle_then_answer", writer, SECRET_ANSWER)


FINE_ANSWER = FINE_HEAD + b"content-length: %d\r\n\r\n" % len(FINE) + FINE
FRAMING: dict[str, Misbehaviour] = {
    "countless_trailers": _trailer_flood(b"x-t: 1\r\n"),
    "endless_trailer": _trailer_flood(b"a" * 64, first=b"x-t: "),
    "then_bytes": _raw(FINE_ANSWER + b"unasked bytes"),
    "then_answer": _raw(FINE_ANSWER + SECRET_ANSWER),
    "chunked_then_answer": _raw(_chunked(FINE) + SECRET_ANSWER),
    "no_content_with_body": _raw(b"HTTP/1.1 204 No Content\r\n\r\n" + SECRET_ANSWER),
    "idle_then_answer": _idle_then_answer,
    "length_and_chunked": _raw(
        _chunked(FINE).replace(b"\r\n\r\n", b"\r\ncontent-length: 2\r\n\r\n", 1)
    ),
    "two_lengths": _raw(
        FINE_HEAD + b"content-length: %d\r\ncontent-length: 2\r\n\r\n" % len(FINE) + FINE
    ),
    "negative_length": _raw(FINE_HEAD + b"content-length: -1\r\n\r\n" + FINE),
    "huge_length": _raw(FINE_HEAD + b"content-length: 99999999999999999999\r\n\r\n" + FINE),
    "chunk_size_overflow": _raw(_chunked(b"").replace(b"0\r\n\r\n", b"f" * 20 + b"\r\n" + FINE)),
    "bare_lf": _raw(FINE_ANSWER.replace(b"\r\n", b"\n")),
    "obs_fold": _raw(FINE_ANSWER.replace(b"content-type:", b"x-folded: a\r\n b\r\ncontent-type:")),
    "http2_status": _raw(FINE_ANSWER.replace(b"HTTP/1.1", b"HTTP/2")),
    "junk_status": _raw(FINE_ANSWER.replace(b"HTTP/1.1 200 OK", b"SPDY 200 fine")),
    "status_below_100": _raw(b"HTTP/1.1 099 Wait\r\n\r\n"),
}


@dataclass
class Tenants:
    a: Gateway
    b: openai.OpenAI


@pytest.fixture(scope="module", params=["http", "https"])
def tenants(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Tenants]:
    """Over http (the gateway's own transport) and https (httpx's, held to the same)."""
    directory = tmp_path_factory.mktemp("framing")
    config = directory / "policy.yaml"
    with hostile.hostile_backend(request.param, directory, FRAMING) as backend:
        config.write_text(f"""
storage: memory
upstream: {{read_timeout: 2s, total_timeout: 10s, probe_interval: 0, circuit: {{failures: 100000}}}}
backends:
  - {{name: hostile, url: "{backend.url}/v1", models: [{MODEL}]}}
models: {{{MODEL}: {{}}}}
tenants:
  a: {{api_keys: [{hash_key("tw-a")}], models: [{MODEL}]}}
  b: {{api_keys: [{hash_key("tw-b")}], models: [{MODEL}]}}
""")
        with replicas(config, 1) as [(process, url)]:
            clients = [
                openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)
                for key in ("tw-a", "tw-b")
            ]
            with clients[0] as a, clients[1] as b:
                yield Tenants(Gateway(process, a, backend), b)


def assert_b_gets_its_own(tenants: Tenants) -> None:
    for stream in (False, True):
        answer = tenants.b.chat.completions.create(
            model=MODEL, messages=MESSAGES, extra_body={"hostile": "normal"}, stream=stream
        )
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
        else:
            text = answer.choices[0].message.content
        assert text == "fine"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("hostile", ["countless_trailers", "endless_trailer"])
def test_endless_trailers_are_a_502_in_bounded_memory(
    tenants: Tenants, hostile: str, stream: bool
) -> None:
    """They took the gateway's memory without bound (4 GB in 8 s) until the total deadline."""
    with PeakRss(tenants.a) as rss:
        if stream:  # an error event, or a 502 if the trailers came in the head's read
            with pytest.raises(openai.APIError) as caught:
                list(
                    tenants.a.client.chat.completions.create(
                        model=MODEL, messages=MESSAGES, extra_body={"hostile": hostile}, stream=True
                    )
                )
            assert isinstance(caught.value.body, dict)
            assert caught.value.body["code"] == "upstream_bad_response"
        else:
            assert_openai_error(refused(tenants.a, hostile), 502, "upstream_bad_response")
    assert rss.peak_bytes < RSS_BOUND_BYTES, f"peak RSS {rss.peak_bytes / 2**20:.0f} MiB"
    assert tenants.a.backend.saw_hang_up(hostile)
    assert_b_gets_its_own(tenants)


@pytest.mark.parametrize(
    "hostile", ["then_bytes", "then_answer", "chunked_then_answer", "no_content_with_body"]
)
def test_bytes_after_an_answer_drop_the_connection(tenants: Tenants, hostile: str) -> None:
    try:
        answer = tenants.a.client.chat.completions.create(
            model=MODEL, messages=MESSAGES, extra_body={"hostile": hostile}
        )
        assert answer.choices[0].message.content == "fine"
    except openai.APIStatusError as error:  # a 204 is no completion
        assert_openai_error(error, 502, "upstream_bad_response")
    assert tenants.a.backend.saw_hang_up(hostile)
    assert_b_gets_its_own(tenants)


def test_an_answer_sent_to_an_idle_connection_drops_it(tenants: Tenants) -> None:
    SENT_LATER.clear()  # set by the other scheme's run
    answer = tenants.a.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, extra_body={"hostile": "idle_then_answer"}
    )
    assert answer.choices[0].message.content == "fine"
    SENT_LATER.set()
    assert tenants.a.backend.saw_hang_up("idle_then_answer")
    assert_b_gets_its_own(tenants)


@pytest.mark.parametrize(
    "hostile",
    [
        "length_and_chunked",
        "two_lengths",
        "negative_length",
        "huge_length",
        "chunk_size_overflow",
        "bare_lf",
        "obs_fold",
        "http2_status",
        "junk_status",
        "status_below_100",
    ],
)
def test_broken_framing_is_a_502(tenants: Tenants, hostile: str) -> None:
    """A status below 100 was taken as an interim answer: the client waited for read_timeout
    (5 minutes by default) for one to follow, and a body it had joined the next answer's."""
    assert_openai_error(refused(tenants.a, hostile), 502, "upstream_error")
    assert tenants.a.backend.saw_hang_up(hostile)
    assert_b_gets_its_own(tenants)
