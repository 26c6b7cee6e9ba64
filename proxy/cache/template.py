"""A stream's template: the bytes around the text of a text-only chunk, and the texts cut out of
events on it without parsing them (proxy/cache/fold.py learns it and folds with it)."""

from __future__ import annotations

from typing import Final

__all__ = ["Template", "plain"]

# A field whose value changes in every chunk: a template's second hole.
_HOLE: Final = b'"obfuscation":"'


class Template:
    """The bytes around the text of a text-only chunk: as a payload, and as a whole event.

    A field every chunk fills anew (OpenAI's `obfuscation`, random padding) is a second hole:
    the bytes from the text to it are `mid`, and its value may be any plain string.
    """

    __slots__ = ("between", "head", "line_end", "mid", "parts", "prefix", "sep", "suffix", "tail")

    def __init__(self, parts: list[bytes], prefix: bytes, suffix: bytes, line: bytes, sep: bytes):
        self.parts = parts  # the text's pieces so far, which a match adds to
        self.prefix = prefix
        self.mid: bytes | None = None
        hole = suffix.find(_HOLE) + len(_HOLE)
        close = suffix.find(b'"', hole)
        if hole >= len(_HOLE) and suffix.count(_HOLE) == 1 and b"\\" not in suffix[hole:close]:
            self.mid, suffix = suffix[:hole], suffix[close:]
        self.suffix = suffix
        self.head = line + prefix  # `line`: what comes before the payload (`data: `)
        self.sep = sep
        self.tail = suffix + sep
        # What follows a text on its line, cut at b"\n": the suffix, and with CRLF a b"\r".
        self.line_end = len(suffix) + len(sep) // 2 - 1
        # Between two texts of a read with several events on the template.
        self.between = self.tail + self.head

    def probe(self, text: bytes) -> bytes:
        """A payload on the template with `text` in its hole or holes."""
        return self.prefix + text + (b"" if self.mid is None else self.mid + text) + self.suffix

    def take(self, data: bytes) -> bool:
        """Keep the texts of a read that is only events on the template, texts without escapes.

        The read is cut at its line ends, and each event's text is what lies between the
        template's head and suffix on its line. Put back between the template's own bytes, the
        texts must give the read again, byte for byte: then every event is the template around
        its text. A text with a quote or a backslash is refused (it could end its string early,
        or escape), and with it the whole read. Work in C over the read, not Python per event.
        """
        inner = _inside(data, self.head, self.tail)
        if inner is None:
            return False
        if self.mid is None and plain(inner):  # the usual: one event
            self.parts.append(inner)
            return True
        if self.mid is not None:
            events = data.split(self.sep)
            events.pop()  # empty: `data` ends with `tail`, which ends with `sep`
            return self._take_padded(events, self.mid)
        # Cut at each b"\n" (one byte is found twice as fast as the separator's two): an event
        # on the template is its line and an empty one (b"\r" with CRLF), and the last line is
        # empty. A read of any other shape fails the check below.
        lines = data.split(b"\n")[0:-1:2]
        start, end = len(self.head), self.line_end
        texts = [line[start : len(line) - end] for line in lines]
        joined = b"".join(texts)
        if not plain(joined) or self.between.join(texts) != inner:
            return False
        self.parts += texts
        return True

    def _take_padded(self, events: list[bytes], mid: bytes) -> bool:
        """`take` for a template with a second hole (`mid` leads to it): event by event."""
        texts = []
        for event in events:
            inner = _inside(event, self.head, self.suffix)
            text = None if inner is None else _cut(inner, mid)
            if text is None:
                return False
            texts.append(text)
        self.parts += texts
        return True

    def text(self, payload: bytes) -> bytes | None:
        """The text of one payload on the template, if it has no escapes."""
        inner = _inside(payload, self.prefix, self.suffix)
        if inner is None:
            return None
        if self.mid is not None:
            return _cut(inner, self.mid)
        return inner if plain(inner) else None


def plain(text: bytes) -> bool:
    """No quote and no backslash in `text`. (`find`, not `in`: on Python 3.11 `bytes in bytes`
    first tries its operand as an integer, raising and clearing a TypeError: about 2,200
    instructions a test, counted by callgrind, where `find` takes 1,200.)"""
    return text.find(b'"') < 0 and text.find(b"\\") < 0


def _cut(inner: bytes, mid: bytes) -> bytes | None:
    """The text of `inner`: a text, `mid`, the second hole's value, both plain strings."""
    end = inner.find(b'"')
    if end < 0 or not inner.startswith(mid, end):
        return None
    text, other = inner[:end], inner[end + len(mid) :]
    return text if text.find(b"\\") < 0 and plain(other) else None


def _inside(data: bytes, head: bytes, tail: bytes) -> bytes | None:
    """What `data` has between `head` and `tail`, if it is just them around it."""
    if len(data) < len(head) + len(tail) or not data.startswith(head) or not data.endswith(tail):
        return None
    return data[len(head) : len(data) - len(tail)]
