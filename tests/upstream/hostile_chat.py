"""Chat streams a hostile backend ends its own way, for HostileBackend's `extra`: usage that
under-reports the deltas sent, and streams closed cleanly before their `data: [DONE]`."""

from __future__ import annotations

from typing import Any

from tests.upstream.hostile import CHUNK, HostileBackend, Misbehaviour, Writer, event, head

DELTAS = 11  # content deltas each stream here sends, when it sends them all
_FINISHED = {**CHUNK, "choices": [{**CHUNK["choices"][0], "finish_reason": "stop"}]}
_USAGE = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}  # believable, but 11
_USAGE_CHUNK = {**CHUNK, "choices": [], "usage": _USAGE}
# llama.cpp's older last chunk: its finish_reason and its usage side by side.
_FINISHED_WITH_USAGE = {**_FINISHED, "usage": _USAGE}
_DONE = b"data: [DONE]\n\n"
_ANSWER = event(CHUNK) * (DELTAS - 1) + event(_FINISHED)


def _closed(body: bytes) -> Misbehaviour:
    """A stream of `body` with its length: the backend closes it cleanly after it."""

    async def answer(server: HostileBackend, writer: Writer, request: dict[str, Any]) -> None:
        data = head("200 OK", "content-type: text/event-stream", f"content-length: {len(body)}")
        await server.send(str(request["hostile"]), writer, data + body)

    return answer


CHAT_ENDINGS: dict[str, Misbehaviour] = {
    "chat_under_reported": _closed(_ANSWER + event(_USAGE_CHUNK) + _DONE),
    "chat_under_reported_in_choice": _closed(
        event(CHUNK) * (DELTAS - 1) + event(_FINISHED_WITH_USAGE) + _DONE
    ),
    # Closed before [DONE]: mid-answer (between events, or half an event), or once complete.
    "chat_ended_between_events": _closed(event(CHUNK) * 3),
    "chat_ended_mid_event": _closed(event(CHUNK) * 3 + event(CHUNK)[:30]),
    "chat_ended_before_usage": _closed(_ANSWER),
    "chat_ended_without_done": _closed(_ANSWER + event(_USAGE_CHUNK)),
}
