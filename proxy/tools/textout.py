"""Text for the command line: standard output whatever the locale, and columns by display width.

Under LC_ALL=C with PYTHONIOENCODING=ascii, or into a file on Windows (cp1252), a tenant, user
or key named 支持 raised UnicodeEncodeError mid-output: a report cut short, a key created whose
secret was never shown.
"""

from __future__ import annotations

import io
import os
import sys
import unicodedata
from typing import TextIO

__all__ = ["StatusLines", "stdout_for", "text_width"]


def stdout_for(*, data: bool) -> TextIO:
    """`sys.stdout`, made to write `data` (CSV, JSON: UTF-8 by their readers' rule) in UTF-8,
    and text for a person in the terminal's encoding with what it cannot show escaped."""
    stdout = sys.stdout
    if isinstance(stdout, io.TextIOWrapper):
        if data:
            stdout.reconfigure(encoding="utf-8")
        else:
            stdout.reconfigure(errors="backslashreplace")
    return stdout


class StatusLines:
    """A command's status lines (stderr) whose reader may go away, as in `tokenweir bench ...
    2>&1 | head -1`: from then on they go nowhere and `gone` says so, and the command goes on
    with its work (a results file) instead of ending on BrokenPipeError."""

    __slots__ = ("_stream", "gone")

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.gone = False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                self._stream.write(text)
            except BrokenPipeError:
                self._went()
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._went()

    def _went(self) -> None:
        self.gone = True
        # What the stream still holds would be flushed at exit into the closed pipe, with a
        # complaint: it goes to /dev/null instead.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
        except OSError:
            return
        try:
            os.dup2(devnull, self._stream.fileno())
        except (OSError, ValueError, io.UnsupportedOperation):
            pass  # not a file (a test's capture): nothing held goes to a pipe
        finally:
            os.close(devnull)


def text_width(text: str) -> int:
    """Terminal columns: wide and full-width characters (CJK, emoji) take two; marks, format
    characters (ZWJ, ZWNJ), a skin tone and what a ZWJ joins to the character before it
    (👨‍👩‍👧 is one emoji) take none; the emoji variation selector widens the one before (❤️)."""
    width = last = 0
    joined = False
    for char in text:
        if char == "\ufe0f":
            if last == 1:  # a narrow character, now shown as an emoji
                width, last = width + 1, 2
        elif not joined and unicodedata.category(char) not in _NO_WIDTH:
            last = 0 if char in _SKIN_TONES else 2 if _wide(char) else 1
            width += last
        joined = char == "\u200d"
    return width


def _wide(char: str) -> bool:
    """Wide, or an emoji newer than this Python's Unicode (unassigned to it, in the emoji planes:
    Python 3.11 knows Unicode 14, not 2023's emoji)."""
    if unicodedata.east_asian_width(char) in ("W", "F"):
        return True
    return "\U0001f000" <= char <= "\U0001faff" and unicodedata.category(char) == "Cn"


_NO_WIDTH = frozenset({"Mn", "Me", "Cf"})
_SKIN_TONES = frozenset(map(chr, range(0x1F3FB, 0x1F400)))
