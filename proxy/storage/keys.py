"""The runtime-key contract: records by id plus a version that every change bumps, so a
replica learns of a change with one cheap read."""

from __future__ import annotations

from typing import Protocol

from proxy.storage.memory.keys import MemoryKeyStore
from proxy.storage.redis.keys import RedisKeyStore
from proxy.storage.redis.link import RedisLink
from proxy.storage.redis.url import check_storage_url

__all__ = ["KeyStore", "open_key_store"]


class KeyStore(Protocol):
    # Whether another process can change the records (Redis: every replica), so the version is
    # worth polling; `memory` keys change only through this process's own calls.
    shared: bool

    async def put(self, key_id: str, record: bytes) -> None:
        """Store (or replace) one record and bump the version."""

    async def delete(self, key_id: str) -> bool:
        """Remove one record (bumping the version); False if there was none."""

    async def records(self) -> dict[str, bytes]:
        """Every record, by id."""

    async def version(self) -> int:
        """A number that changes whenever a record does."""

    async def aclose(self) -> None: ...


def open_key_store(url: str, link: RedisLink | None = None) -> KeyStore:
    """Runtime keys on the policy's storage: this process's memory, or Redis (every replica):
    on `link` when given (the storage's, which its owner closes), else on a link of their own."""
    if check_storage_url(url) == "memory":
        return MemoryKeyStore()
    return RedisKeyStore(link if link is not None else url)
