"""Units in policy files: durations (`30s`, `5m`, `1h`, `7d`), byte sizes, hashed keys, and a
SQLite ledger's URL with its options."""

from __future__ import annotations

import hashlib
import math
import re

__all__ = ["MIN_KEEP_RECORDS_S", "hash_key", "parse_bytes", "parse_duration_s", "split_sqlite_url"]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")
_DURATION_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
MIN_KEEP_RECORDS_S = 3600.0
# Longer is a mistake (and past what Redis expiry times and thread timeouts take).
MAX_DURATION_S = 100 * 365 * 86400.0
_SIZE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB|KB|MB|GB)?\s*$")
_SIZE_UNIT = {
    None: 1,
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
}


def parse_duration_s(value: object) -> float:
    """`30s`, `5m`, `1h`, `7d`, `250ms`, or a bare number of seconds, as seconds."""
    if isinstance(value, bool):
        raise ValueError("expected a duration like 30s, 5m, 1h or 7d")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.match(value)):
        seconds = float(match.group(1)) * _DURATION_UNIT_S[match.group(2)]
    else:
        raise ValueError(f"expected a duration like 30s, 5m, 1h or 7d, got {value!r}")
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"a duration is a number of seconds, 0 or more, got {value!r}")
    if seconds > MAX_DURATION_S:
        raise ValueError(f"a duration is at most 36500d (100 years), got {value!r}")
    return seconds


def parse_bytes(value: object) -> int:
    """`512KiB`, `4MiB`, `1GB`, or a bare number of bytes, as bytes."""
    if isinstance(value, bool):
        raise ValueError("expected a size like 4MiB")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (match := _SIZE.match(value)):
        size = int(match.group(1)) * _SIZE_UNIT[match.group(2)]
    else:
        raise ValueError(f"expected a size like 512KiB or 4MiB, got {value!r}")
    if size <= 0:
        raise ValueError("a size must be positive")
    return size


def hash_key(key: str) -> str:
    """The stored form of an API key: `sha256:<hex>` of its UTF-8 bytes."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def split_sqlite_url(url: str) -> tuple[str, float | None]:
    """`sqlite:///path.db` or `sqlite:///path.db?keep_records=90d`: the file's path, and how long
    its raw records are kept (None: for ever). ValueError names what is wrong."""
    path, _, options = url.removeprefix("sqlite:///").partition("?")
    keep_s: float | None = None
    for option in filter(None, options.split("&")):
        name, equals, value = option.partition("=")
        if name != "keep_records" or not equals or keep_s is not None:
            raise ValueError(
                f"a sqlite ledger takes one option, keep_records (as in "
                f"sqlite:///tokenweir.db?keep_records=90d), not {option!r}"
            )
        keep_s = parse_duration_s(value)
        if keep_s < MIN_KEEP_RECORDS_S:
            raise ValueError(f"keep_records must be at least 1h, got {value!r}")
    return path, keep_s
