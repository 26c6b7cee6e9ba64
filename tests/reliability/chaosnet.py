"""The chaos test's raw parts: a backend that counts every token it writes (on the hostile
backend's server, tests/upstream/hostile.py) and a raw-socket client that can leave at any point.

The backend answers a request whose `hostile` field is "chaos" by its `chaos` field: `tokens`
(the answer's length), `cut_after` (drop the connection after that many tokens of a stream),
`delay_s` (wait before the head); it counts the tokens it wrote per `chaos_id`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from tests.upstream.hostile import HostileBackend, event, head, json_answer

PROMPT_TOKENS = 7  # what the raw backend says every prompt cost
Leave = Literal["never", "early", "mid", "end"]


class RawCounts:
    """Tokens the raw backend wrote, per request (its `chaos_id`)."""

    def __init__(self) -> None:
        self.written: Counter[str] = Counter()
        self.prompts: Counter[str] = Counter()

    async def answer(self, server: HostileBackend, writer: Any, request: dict[str, Any]) -> None:
        plan, rid = request["chaos"], str(request["chaos_id"])
        await asyncio.sleep(plan.get("delay_s", 0))
        tokens, cut_after = int(plan["tokens"]), plan.get("cut_after")
        if not request.get("stream"):
            self.written[rid] += tokens
            self.prompts[rid] += PROMPT_TOKENS
            body = orjson.dumps(_whole(tokens))
            await server.send("chaos", writer, json_answer("200 OK", body) + body)
            return
        await server.send("chaos", writer, head("200 OK", "content-type: text/event-stream"))
        for i in range(tokens):
            if cut_after is not None and i == cut_after:
                writer.transport.abort()
                return
            self.written[rid] += 1
            await server.send("chaos", writer, event(_chunk({"content": " w"}, None)))
        self.prompts[rid] += PROMPT_TOKENS
        tail = event(_chunk({}, "stop"))
        if (request.get("stream_options") or {}).get("include_usage"):
            tail += event({**_chunk({}, None), "choices": [], "usage": _usage(tokens)})
        await server.send("chaos", writer, tail + b"data: [DONE]\n\n")
        writer.close()  # the stream's end is the connection's (no length, not chunked)


def _usage(tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": tokens,
        "total_tokens": PROMPT_TOKENS + tokens,
    }


def _chunk(delta: dict[str, str], finish: str | None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-chaos", "object": "chat.completion.chunk", "created": 1,
        "model": "raw-llm", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }  # fmt: skip


def _whole(tokens: int) -> dict[str, Any]:
    message = {"role": "assistant", "content": " ".join(["w"] * tokens)}
    return {
        "id": "chatcmpl-chaos", "object": "chat.completion", "created": 1, "model": "raw-llm",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": _usage(tokens),
    }  # fmt: skip


@contextlib.contextmanager
def raw_backend() -> Iterator[tuple[HostileBackend, RawCounts]]:
    counts = RawCounts()
    with HostileBackend({"chaos": counts.answer}) as backend:
        yield backend, counts


@dataclass
class Sent:
    """One request as its client saw it: what it asked, and what came back before it left."""

    rid: str
    key: str
    body: dict[str, Any]
    leave: Leave
    status: int | None = None
    answer: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)

    def payload(self) -> bytes:
        """The answer's body, its chunked framing (if any) taken off."""
        if self.headers.get("transfer-encoding") != "chunked":
            return self.answer
        body, rest = b"", self.answer
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                break
            body, rest = body + rest[:size], rest[size + 2 :]
        return body


async def send(base_port: int, sent: Sent, rng: random.Random) -> None:
    """POST the chat request on a new connection and read as `sent.leave` says: all of it
    (never), nothing (early: gone after a moment), up to the first event (mid), or up to the
    finish reason, before the usage and [DONE] (end)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", base_port)
    try:
        payload = orjson.dumps(sent.body)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\n"
            b"authorization: Bearer %s\r\nx-request-id: %s\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (sent.key.encode(), sent.rid.encode(), len(payload), payload)
        )
        await writer.drain()
        if sent.leave == "early":
            await asyncio.sleep(rng.uniform(0, 0.2))
            return
        await _read(reader, sent)
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.transport.abort()


async def _read(reader: asyncio.StreamReader, sent: Sent) -> None:
    head_bytes = await reader.readuntil(b"\r\n\r\n")
    lines = head_bytes.decode("latin-1").split("\r\n")
    sent.status = int(lines[0].split()[1])
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            sent.headers[name.strip().lower()] = value.strip()
    marker = {"mid": b"data: ", "end": b'"finish_reason":"'}.get(sent.leave)
    while chunk := await reader.read(65536):
        sent.answer += chunk
        if marker is not None and marker in sent.answer:
            return
