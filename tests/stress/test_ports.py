"""tests/servers.py `free_port`: two pytest-xdist workers never hand out the same port."""

from __future__ import annotations

import pytest

from tests.servers import _worker_slice, free_port


def test_each_worker_draws_from_a_slice_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    slices = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        slices.append(_worker_slice(20000, 32768))
    (a_first, a_end), (b_first, b_end) = slices
    assert a_first == 20000
    assert a_end <= b_first
    assert b_end <= 32768
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    ports = {free_port() for _ in range(50)}
    assert all(b_first <= port < b_end for port in ports)
    assert len(ports) == 50  # none handed out twice


def test_outside_xdist_the_whole_range_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    assert _worker_slice(20000, 32768) == (20000, 32768)
