"""The mock's stored Responses, as OpenAI keeps them: a response made with `store` (true unless
the request says false) is kept, read back with GET /v1/responses/{id}, deleted with DELETE, and
continued with `previous_response_id` (its conversation read as part of the next prompt).

Kept in memory, newest first, within MAX_RESPONSES responses and MAX_BYTES of their JSON and
conversation text; the oldest go first, as if they had expired.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Final

import orjson

from proxy.tools.mock.request import TOKENS_PER_MESSAGE, MockHTTPError

__all__ = ["MAX_BYTES", "MAX_RESPONSES", "KeptResponses", "Transcript", "finished_response"]

MAX_RESPONSES: Final = 4096
MAX_BYTES: Final = 64 * 1024 * 1024
_PREFIX: Final = "/v1/responses/"


@dataclass(frozen=True, slots=True)
class Transcript:
    """A conversation so far: its text and the mock's count of its tokens."""

    text: str
    tokens: int

    def then(self, text: str, tokens: int) -> Transcript:
        return Transcript(f"{self.text}\n{text}" if self.text else text, self.tokens + tokens)


@dataclass(frozen=True, slots=True)
class _Kept:
    response: bytes
    transcript: Transcript

    @property
    def size(self) -> int:
        return len(self.response) + len(self.transcript.text)


class KeptResponses:
    """The stored responses of one mock backend."""

    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES) -> None:
        self._kept: OrderedDict[str, _Kept] = OrderedDict()
        self._bytes = 0
        self._max_responses = max_responses
        self._max_bytes = max_bytes

    def history(self, body: dict[str, Any]) -> Transcript | None:
        """The conversation a Responses request continues; None if it names none. A
        `previous_response_id` not kept (never stored, deleted, or expired) is OpenAI's 400."""
        previous = body.get("previous_response_id")
        if previous is None:
            return None
        kept = self._kept.get(previous) if isinstance(previous, str) else None
        if kept is None:
            raise MockHTTPError(
                400,
                f"Previous response with id '{previous}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return kept.transcript

    def keep(self, response: bytes, prompt: Transcript, output: str, output_tokens: int) -> None:
        """Keep a finished response (its JSON) and its conversation: `prompt` then `output`."""
        response_id = orjson.loads(response)["id"]
        kept = _Kept(response, prompt.then(output, output_tokens + TOKENS_PER_MESSAGE))
        self._drop(response_id)
        self._kept[response_id] = kept
        self._bytes += kept.size
        while len(self._kept) > self._max_responses or self._bytes > self._max_bytes:
            self._drop(next(iter(self._kept)))

    def _drop(self, response_id: str) -> bool:
        kept = self._kept.pop(response_id, None)
        if kept is not None:
            self._bytes -= kept.size
        return kept is not None

    def answer(self, method: str, path: str) -> bytes:
        """GET or DELETE /v1/responses/{id}: the response, or OpenAI's deletion record."""
        response_id = path[len(_PREFIX) :]
        kept = self._kept.get(response_id)
        if method == "GET" and kept is not None:
            return kept.response
        if method == "DELETE" and self._drop(response_id):
            return orjson.dumps({"id": response_id, "object": "response", "deleted": True})
        if method not in ("GET", "DELETE"):
            raise MockHTTPError(405, f"Method {method} not allowed on {_PREFIX}{{id}}.")
        raise MockHTTPError(404, f"Response with id '{response_id}' not found.")

    @staticmethod
    def serves(path: str) -> bool:
        return path.startswith(_PREFIX) and "/" not in path[len(_PREFIX) :]


def finished_response(tail: bytes) -> bytes:
    """The finished response in a Responses stream's tail, whose last event carries it."""
    event = orjson.loads(tail.rstrip(b"\n").rsplit(b"\ndata: ", 1)[1])
    return orjson.dumps(event["response"])
