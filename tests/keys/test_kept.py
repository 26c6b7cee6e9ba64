"""The runtime keys kept for the workers of `serve --workers N`: the latest read wins, and a key
revoked through the server never comes back from a read that started before the revocation."""

from __future__ import annotations

from pathlib import Path

from proxy.keys.kept import KeptKeys


def test_a_late_read_neither_replaces_a_newer_one_nor_brings_back_a_revoked_key(
    tmp_path: Path,
) -> None:
    kept, sibling = KeptKeys(tmp_path / "keys.kept"), KeptKeys(tmp_path / "keys.kept")
    assert kept.read() == {}  # nothing kept yet
    kept.keep(2, {"key_a": b'{"a": 2}', "key_b": b"{}"})
    sibling.keep(1, {"key_a": b'{"a": 1}'})  # read before version 2, written after it
    assert kept.read() == {"key_a": b'{"a": 2}', "key_b": b"{}"}
    sibling.revoke("key_b")
    kept.keep(2, {"key_a": b'{"a": 2}', "key_b": b"{}"})  # read before the revocation
    assert kept.read() == {"key_a": b'{"a": 2}'}
    sibling.add("key_c", b"{}")
    assert set(kept.read()) == {"key_a", "key_c"}
    kept.keep(0, {}, restarted=True)  # the storage lost its data: its version went back
    assert kept.read() == {}


def test_nothing_kept_where_the_directory_is_gone(tmp_path: Path) -> None:
    gone = KeptKeys(tmp_path / "no-such-directory" / "keys.kept")
    gone.keep(1, {"key_a": b"{}"})  # the server is stopping: a warning, no error
    assert gone.read() == {}
