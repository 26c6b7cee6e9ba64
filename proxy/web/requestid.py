"""Pure ASGI middleware: every answer carries `x-request-id` (the client's if sane, else new).

A new id is `req_` and 128 random bits in hex, as uuid4's hex was (uuid.uuid4 cost about
3 µs a request, most of it building a UUID object only to read its hex back). The bits come from
`random`, as the trace ids do: an id is a label (a client may send its own), not a secret, and
os.urandom lets go of the GIL for its system call, which hands the event loop's turn to whichever
thread is waiting for it (the ledger's writer, the span exporter) in the middle of a request.
"""

from __future__ import annotations

import re
from random import getrandbits

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.asgi.direct import LentCycle
from proxy.asgi.head import write_head
from proxy.asgi.held import HeldHead, hold_head

__all__ = ["REQUEST_ID_KEY", "IdSender", "RequestId", "assign_request_id"]

REQUEST_ID_KEY = "tokenweir.request_id"
_SANE = re.compile(rb"^[A-Za-z0-9._:-]{1,128}$")


class RequestId:
    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        await self._app(scope, receive, IdSender(send, assign_request_id(scope)))


def assign_request_id(scope: Scope) -> bytes:
    """The request's id (the client's if sane, else new), also set as `scope[REQUEST_ID_KEY]`."""
    request_id = _from_client(scope) or b"req_%032x" % getrandbits(128)
    scope[REQUEST_ID_KEY] = request_id.decode()
    return request_id


class IdSender:
    """`send`, with `x-request-id` added to the response's start; `started` once that went.
    Given the request's lent cycle (the fast lane), it writes the start itself as uvicorn would
    (proxy/asgi/head.py) and holds that write until the first body message has gone, so the two
    leave in one write (proxy/asgi/held.py)."""

    __slots__ = ("_held", "_lent", "_request_id", "_send", "started")

    def __init__(self, send: Send, request_id: bytes, lent: LentCycle | None = None) -> None:
        self._send = send
        self._request_id = request_id
        self._lent = lent
        self._held: HeldHead | None = None
        self.started = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            headers = message["headers"] = [
                *message.get("headers", ()),
                (b"x-request-id", self._request_id),
            ]
            held = self._held = hold_head(self._lent)
            if held is None or not write_head(held.cycle, message["status"], headers):
                await self._send(message)
            return
        try:
            await self._send(message)
        finally:
            if self._held is not None:
                self._held.release()
                self._held = None


def _from_client(scope: Scope) -> bytes | None:
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            return value if _SANE.match(value) else None
    return None
