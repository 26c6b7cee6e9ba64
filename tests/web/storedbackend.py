"""A backend on 127.0.0.1 that keeps Responses by id as vLLM does: a raw asyncio server on a
thread of its own. A response stored (`store` is not false) is the input it was asked; a request
naming it in `previous_response_id` is answered with that input (as a model given the history
would repeat it), whoever asks; an id it does not have is vLLM's 404. A request's `request_id`
is its response's id, as in vLLM (one storing over another's id replaces it). Chat completions
answer "ok". Every request body it got is kept, in order.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson

MODEL = "stored-llm"


class StoredBackend:
    def __init__(self) -> None:
        self.url = ""
        self.bodies: list[dict[str, Any]] = []
        self.stored: dict[str, str] = {}
        self.store_enabled = True  # vLLM stores only with VLLM_ENABLE_RESPONSES_API_STORE set
        self.containers: dict[str, str] = {}  # what each code-execution container holds
        self._ids = itertools.count(1)
        self.writers: set[asyncio.StreamWriter] = set()

    def asked(self, path_field: str) -> list[Any]:
        """The values of one field in the bodies asked so far (None where a body had none)."""
        return [body.get(path_field) for body in self.bodies]

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                request_line, *lines = head.decode("latin-1").split("\r\n")
                length = 0
                for line in lines:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                raw = await reader.readexactly(length) if length else b""
                writer.write(self._answer(request_line.split(" ")[1], raw))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.writers.discard(writer)
            writer.close()

    def _answer(self, path: str, raw: bytes) -> bytes:
        if path == "/v1/models":
            return _whole(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        body = orjson.loads(raw)
        self.bodies.append(body)
        if path == "/v1/messages":
            return self._message(body)
        if path == "/v1/chat/completions":
            message = {"role": "assistant", "content": "ok"}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
            return _whole(200, {"id": "chatcmpl-1", "object": "chat.completion", "created": 1,
                                "model": MODEL, "choices": [choice], "usage": usage})  # fmt: skip
        previous = body.get("previous_response_id")
        text = "ok"
        if previous is not None:
            if previous not in self.stored:
                message = f"Response with id '{previous}' not found."
                return _whole(404, {"error": {"message": message, "type": "NotFoundError"}})
            text = f"Earlier you said: {self.stored[previous]}"
        stored = self.store_enabled and body.get("store") is not False
        response = self._response(text, body.get("request_id"), stored=stored)
        if stored:
            self.stored[response["id"]] = str(body.get("input"))
        if not body.get("stream"):
            return _whole(200, response)
        events = [
            {"type": "response.created", "response": {**response, "status": "in_progress"}},
            {"type": "response.output_text.delta", "delta": text, "output_index": 0},
            {"type": "response.completed", "response": response},
        ]
        return _stream(b"".join(_event(e) for e in events))

    def _message(self, body: dict[str, Any]) -> bytes:
        """Anthropic's code execution, as far as its container goes: a request naming none
        gets a new one holding its first message; one naming a container is answered with
        what that holds, whoever asks."""
        given = body.get("container")
        given = given.get("id") if isinstance(given, dict) else given
        if given is None:
            container = f"container_{next(self._ids)}"
            self.containers[container] = str(body["messages"][0]["content"])
            text = "ok"
        elif given in self.containers:
            container, text = given, f"The container holds: {self.containers[given]}"
        else:
            error = {"type": "not_found_error", "message": "container not found"}
            return _whole(404, {"type": "error", "error": error})
        held = {"id": container, "expires_at": "2030-01-01T00:00:00Z"}
        usage = {"input_tokens": 3, "output_tokens": 1}
        message = {"id": "msg_1", "type": "message", "role": "assistant", "model": MODEL,
                   "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
                   "stop_sequence": None, "usage": usage, "container": held}  # fmt: skip
        if not body.get("stream"):
            return _whole(200, message)
        events = [
            {"type": "message_start", "message": {**message, "content": [], "container": None}},
            {"type": "content_block_start", "index": 0,
             "content_block": {"type": "text", "text": ""}},
            {"type": "content_block_delta", "index": 0,
             "delta": {"type": "text_delta", "text": text}},
            {"type": "content_block_stop", "index": 0},
            {"type": "message_delta", "delta": {"stop_reason": "end_turn", "container": held},
             "usage": {"output_tokens": 1}},
            {"type": "message_stop"},
        ]  # fmt: skip
        return _stream(b"".join(b"event: %s\n" % e["type"].encode() + _event(e) for e in events))

    def _response(self, text: str, chosen: str | None, *, stored: bool) -> dict[str, Any]:
        """The answer, under the id the request chose (vLLM's `request_id`) or a new one,
        saying whether it was stored (vLLM's says `store: false` with its store off)."""
        part = {"type": "output_text", "text": text, "annotations": []}
        item = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                "content": [part]}  # fmt: skip
        usage = {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4}
        answer_id = chosen or f"resp_{next(self._ids):032x}"
        return {"id": answer_id, "object": "response", "created_at": 1, "model": MODEL,
                "status": "completed", "output": [item], "usage": usage,
                "store": stored}  # fmt: skip


def _event(payload: object) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def _stream(events: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    return head + b"content-length: %d\r\n\r\n" % len(events) + events


def _whole(status: int, answer: object) -> bytes:
    body = orjson.dumps(answer)
    reason = b"OK" if status == 200 else b"Not Found"
    head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n" % (status, reason)
    return head + b"content-length: %d\r\n\r\n" % len(body) + body


@contextmanager
def stored_backend() -> Iterator[StoredBackend]:
    backend = StoredBackend()
    started = threading.Event()
    loop = asyncio.new_event_loop()

    async def listen() -> asyncio.Server:
        return await asyncio.start_server(backend.serve, "127.0.0.1", 0)

    def run() -> None:
        asyncio.set_event_loop(loop)
        server = loop.run_until_complete(listen())
        backend.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        started.set()
        loop.run_forever()
        server.close()
        for writer in list(backend.writers):
            writer.transport.abort()  # the gateway's pooled connections: each handler returns
        loop.run_until_complete(server.wait_closed())
        loop.close()

    thread = threading.Thread(target=run, name="stored-backend", daemon=True)
    thread.start()
    assert started.wait(10), "the stored backend did not start"
    try:
        yield backend
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
