"""Standard output for the command line's reports and answers, whatever the locale.

Under LC_ALL=C with PYTHONIOENCODING=ascii, or into a file on Windows (cp1252), a tenant, user
or key named 支持 raised UnicodeEncodeError mid-output: a report cut short, a key created whose
secret was never shown.
"""

from __future__ import annotations

import io
import sys
from typing import TextIO

__all__ = ["stdout_for"]


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
