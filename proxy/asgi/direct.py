"""A stream's middle chunks written straight to the client's connection, past the ASGI stack.

A relayed token otherwise wakes the request's task, resumes every coroutine frame between the
server and the upstream read, and goes back out through each middleware's `send` wrapper into
uvicorn's, which frames it and writes it to the transport. Under `tokenweir serve` (uvicorn's
httptools protocol, proxy/asgi/protocol.py) the protocol lends each request's scope its
response cycle; while the relay's task waits for the backend, a read the cycle can take at once
is framed as uvicorn frames it and written by the upstream connection's own callback.

What that relies on, and keeps:
- every `send` wrapper of the app passes a middle body chunk (`more_body` true) through as it
  is; the wrappers act on the response's start and its last chunk, which still go through
  them (the request's holds are settled before the last byte, the request id is stamped on the
  head, the Messages API's error rewriting sees the end);
- the cycle takes a chunk at once only while uvicorn would: the head is sent with chunked
  framing, the body is not complete, the client is connected (and its transport not closing)
  and its socket is not over its write buffer's high-water mark (`ready`); otherwise the read
  goes to the task, whose `send` waits for the client as before.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, MutableMapping
from typing import Any, Final, cast

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

__all__ = [
    "SERVER_CYCLE", "DirectBody", "LentCycle", "body_arrived", "cut_off_stalled", "direct_body",
    "has_cycle_fields", "lend_cycle", "lent_cycle",
]  # fmt: skip

# The scope's key for a weak reference to uvicorn's response cycle (weak: the cycle holds the
# scope, and a strong reference back would leave every request to the cyclic collector).
SERVER_CYCLE: Final = "tokenweir.server_cycle"
LentCycle = weakref.ref[RequestResponseCycle]


# What DirectBody, write_head (proxy/asgi/head.py) and body_arrived read of a cycle and its
# flow control: uvicorn's own, not its public API.
_CYCLE_FIELDS: Final = (
    "chunked_encoding", "response_started", "response_complete", "disconnected", "flow",
    "transport", "access_log", "default_headers", "expected_content_length", "keep_alive",
    "scope", "waiting_for_100_continue", "more_body", "message_event",
)  # fmt: skip
# Per cycle class, whether its instances have them all (judged on the first one lent).
_fits: dict[type, bool] = {}


def lend_cycle(scope: object, cycle: RequestResponseCycle | None) -> None:
    """Called by the protocol once it made the request's cycle for `scope`, before the app runs
    (a request the protocol answers itself, such as an upgrade, has no cycle of its own). A
    uvicorn whose cycles lack what DirectBody and write_head read lends nothing: its answers go
    through `send`, as under any other server."""
    if cycle is None or cycle.scope is not scope:
        return
    fits = _fits.get(type(cycle))
    if fits is None:
        fits = _fits[type(cycle)] = has_cycle_fields(cycle)
    if fits:
        cast(MutableMapping[str, Any], scope)[SERVER_CYCLE] = weakref.ref(cycle)


def has_cycle_fields(cycle: object) -> bool:
    """True if `cycle` has what DirectBody and write_head read of it."""
    flow = getattr(cycle, "flow", None)
    transport = getattr(cycle, "transport", None)
    return (
        all(hasattr(cycle, name) for name in _CYCLE_FIELDS)
        and hasattr(flow, "write_paused")
        and callable(getattr(getattr(cycle, "message_event", None), "is_set", None))
        and callable(getattr(transport, "is_closing", None))
        and callable(getattr(transport, "write", None))
    )


def lent_cycle(scope: Mapping[str, Any]) -> LentCycle | None:
    """What the server lent the request (nothing is built: most requests never stream)."""
    lent: LentCycle | None = scope.get(SERVER_CYCLE)
    return lent


def body_arrived(lent: LentCycle | None) -> bool:
    """True when the server holds the request's whole body already, so that `receive` hands it
    over without waiting: the cycle's message is complete (no more body to come) and its event
    is set. False where nothing was lent (any other server): the caller waits as for any."""
    cycle = None if lent is None else lent()
    return (
        cycle is not None
        and not cycle.more_body
        and cycle.message_event.is_set()
        and not cycle.disconnected
        and not cycle.response_complete
    )


def cut_off_stalled(lent: LentCycle | None) -> bool:
    """Drop the connection of a client that reads nothing now (its socket past the write
    buffer's high-water mark), and say so: uvicorn's `send` would wait for it to read before
    writing an answer's last bytes, up to the stall timeout. False where nothing was lent."""
    cycle = None if lent is None else lent()
    if cycle is None or not cycle.flow.write_paused or cycle.transport.is_closing():
        return False
    cycle.transport.abort()
    return True


def direct_body(lent: LentCycle | None) -> DirectBody | None:
    """A stream's direct writer, if its server lent it a cycle that is still there."""
    cycle = None if lent is None else lent()
    return None if cycle is None else DirectBody(cycle)


class DirectBody:
    """Writes a response's middle body chunks to its cycle's transport, framed as uvicorn's
    `send` frames them."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = cycle

    def ready(self) -> bool:
        """True while uvicorn's `send` would write a middle chunk at once, without waiting; and
        the transport is not closing. (A write error closes it and only schedules the protocol's
        `connection_lost`, which marks the cycle disconnected: uvicorn's `send`, woken later,
        finds the mark; a callback running in between must not write to a closed transport.)"""
        cycle = self._cycle
        return (
            cycle.chunked_encoding is True
            and cycle.response_started
            and not cycle.response_complete
            and not cycle.disconnected
            and not cycle.flow.write_paused
            and not cycle.transport.is_closing()
        )

    def write(self, body: bytes) -> None:
        """One non-empty middle chunk; only after `ready()` said so, in the same callback."""
        self._cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
