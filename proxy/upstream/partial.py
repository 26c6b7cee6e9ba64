"""The start of one stream event, held back until a later read completes it; where events end."""

from __future__ import annotations

import re
import sys

__all__ = ["EVENT_END", "EVENT_ENDS", "MAX_HELD_BYTES", "Partial", "after_last_end"]

# A backend that never ends an event must not make us hold its bytes forever.
MAX_HELD_BYTES = 1 << 20
# An event ends at a blank line: a line end (LF or CRLF) then another, in any mix; a stream may
# change from one to the other (the spec allows it). A lone CR is not taken as a line end: such
# a stream is refused at its first event (wellformed.py).
EVENT_ENDS = (b"\n\n", b"\n\r\n")
# An event's end with its last line's own end: the bytes between events, as sent.
EVENT_END = re.compile(rb"\r?\n\r?\n")


def after_last_end(data: bytes, start: int = 0, stop: int = sys.maxsize) -> int:
    """Where the last event ending in `data[start:stop]` ends (past its blank line), or -1."""
    lf, crlf = data.rfind(b"\n\n", start, stop), data.rfind(b"\n\r\n", start, stop)
    return max(lf + 2 if lf >= 0 else -1, crlf + 3 if crlf >= 0 else -1)


class Partial:
    """Reads that hold no event end yet, kept as they came (no copy a read): only each new
    read, with the few bytes before it, is searched for the end, so a backend that trickles
    one long event costs work in proportion to its bytes, not to their square."""

    __slots__ = ("_pieces", "_seam", "size")

    def __init__(self) -> None:
        self._pieces: list[bytes] = []
        self._seam = b""  # the held bytes' last three: an event end may straddle a read
        self.size = 0

    def start(self, data: bytes) -> None:
        """Hold `data`, the start of an event (the forwarder found no end in it)."""
        self._pieces.append(data)
        self._seam = data[-3:]
        self.size = len(data)

    def take(self, data: bytes, ends: tuple[bytes, ...]) -> bytes | None:
        """The held bytes and `data` as one, once `data` holds one of `ends` (an event's end,
        of at most four bytes, found across the seam too) or they pass MAX_HELD_BYTES; else
        None, `data` held too."""
        seam = self._seam
        across = seam + data[:3]
        if not any(across.find(end) >= 0 or data.find(end) >= 0 for end in ends):
            if self.size + len(data) <= MAX_HELD_BYTES:
                self._pieces.append(data)
                self._seam = (seam + data[-3:])[-3:]
                self.size += len(data)
                return None
        return self.drain(data)

    def peek(self) -> bytes:
        """Everything held, still held: what a stream closed mid-event left of its last one."""
        return b"".join(self._pieces)

    def drain(self, data: bytes = b"") -> bytes:
        """Everything held, then `data`; nothing is held after."""
        self._pieces.append(data)
        whole = b"".join(self._pieces)
        self._pieces.clear()
        self._seam = b""
        self.size = 0
        return whole
