"""An event a backend trickles in many reads, or never ends: held until whole, forwarded byte
for byte; past MAX_HELD_BYTES forwarded as it stands, so memory stays bounded. Both stream
forwarders (chat's and the named-event APIs') hold it the same way."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from proxy.apis import AGENT_APIS, EventForwarder
from proxy.upstream.partial import MAX_HELD_BYTES
from proxy.upstream.sse import SSEForwarder

Forwarder = SSEForwarder | EventForwarder
FORWARDERS: dict[str, Callable[[], Forwarder]] = {
    "chat": lambda: SSEForwarder(keep_usage=True),
    "messages": lambda: EventForwarder(AGENT_APIS["messages"].events),
}


def first_event(kind: str, sep: bytes) -> bytes:
    if kind == "chat":
        return b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}' + sep
    return b'event: ping\ndata: {"type":"ping"}'.replace(b"\n", sep[: len(sep) // 2]) + sep


@pytest.mark.parametrize("kind", FORWARDERS)
@pytest.mark.parametrize("sep", [b"\n\n", b"\r\n\r\n"])
@pytest.mark.parametrize("read", [1, 3, 100])
def test_an_event_trickled_in_many_reads_goes_out_whole_when_it_ends(
    kind: str, sep: bytes, read: int
) -> None:
    forwarder = FORWARDERS[kind]()
    start = first_event(kind, sep)
    assert forwarder.feed(start)[0] == start
    text = b"x" * 3000
    long = b'data: {"type":"ping","pad":"' + text + b'"}' + sep
    nxt = first_event(kind, sep)
    raw = long + nxt[: len(nxt) // 2]
    written = [forwarder.feed(raw[i : i + read])[0] for i in range(0, len(raw), read)]
    assert b"".join(written) == long  # nothing before its end arrived, then all of it at once
    assert [w for w in written if w] == [long]
    assert forwarder.finish() == nxt[: len(nxt) // 2]  # the next event's start, as it came


@pytest.mark.parametrize("kind", FORWARDERS)
def test_an_event_that_never_ends_goes_out_past_the_cap_and_holding_starts_over(
    kind: str,
) -> None:
    forwarder = FORWARDERS[kind]()
    start = first_event(kind, b"\n\n")
    forwarder.feed(start)
    piece = b"y" * 10_000
    sent = 0
    fed = 0
    for _ in range(3 * MAX_HELD_BYTES // len(piece)):
        fed += len(piece)
        out, _ = forwarder.feed(piece)
        sent += len(out)
        assert 0 <= fed - sent <= MAX_HELD_BYTES  # what is held stays under the cap
    assert sent >= 2 * MAX_HELD_BYTES
    assert sent + len(forwarder.finish()) == fed
