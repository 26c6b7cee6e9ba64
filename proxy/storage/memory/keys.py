"""Runtime keys in this process's memory (the `memory` storage: one process, lost on exit)."""

from __future__ import annotations

__all__ = ["MemoryKeyStore"]


class MemoryKeyStore:
    shared = False  # only this process changes it: no version to poll

    def __init__(self) -> None:
        self._records: dict[str, bytes] = {}
        self._version = 0

    async def put(self, key_id: str, record: bytes) -> None:
        self._records[key_id] = record
        self._version += 1

    async def delete(self, key_id: str) -> bool:
        if self._records.pop(key_id, None) is None:
            return False
        self._version += 1
        return True

    async def records(self) -> dict[str, bytes]:
        return dict(self._records)

    async def version(self) -> int:
        return self._version

    async def aclose(self) -> None:
        return None
