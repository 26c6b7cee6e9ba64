"""Durations, sizes and key hashes as policy files write them."""

from __future__ import annotations

import pytest

from proxy.policy.units import hash_key, parse_bytes, parse_duration_s


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30s", 30.0), ("5m", 300.0), ("1h", 3600.0), ("7d", 604800.0), ("250ms", 0.25), (2, 2.0)],
)
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration_s(text) == seconds


@pytest.mark.parametrize(
    "text", ["5 minutes", "-1s", True, "1w", None, -1, float("nan"), float("inf"), "36501d"]
)
def test_bad_durations(text: object) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration_s(text)


def test_sizes() -> None:
    assert parse_bytes("64KiB") == 65536
    assert parse_bytes("4MiB") == 4 * 1024 * 1024
    assert parse_bytes("1MB") == 1_000_000
    assert parse_bytes(100) == 100
    with pytest.raises(ValueError, match="size"):
        parse_bytes("4 parsecs")


def test_hash_key_is_sha256_hex() -> None:
    assert hash_key("abc") == (
        "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    )
