"""Which tenant made each object a backend stores by id (a Responses answer): remembered as the
answer goes out, asked when a request names one, in this process's memory or in Redis (so an id
made through one replica is its tenant's on every replica). Neither keeps an id's text."""

from __future__ import annotations

import hashlib
from typing import Protocol

from proxy.storage.facade import Storage
from proxy.storage.redis.link import RedisLink
from proxy.storage.redis.marks import RedisMarks

__all__ = ["MemoryOwnedIds", "OwnedIds", "RedisOwnedIds", "open_owned_ids", "owner_key"]

# A process on `storage: memory` forgets a tenant's oldest ids past this many (about 120 bytes
# each): a forgotten id is refused as unknown, never served to another tenant, and one tenant's
# many answers push out none of another's.
MEMORY_IDS = 100_000


class OwnedIds(Protocol):
    async def claim(self, tenant: str, object_id: str, until_wall: float) -> None:
        """`object_id` is `tenant`'s until `until_wall`."""

    async def owns(self, tenant: str, object_id: str, now_wall: float) -> bool: ...

    async def aclose(self) -> None: ...


class MemoryOwnedIds:
    def __init__(self, most: int = MEMORY_IDS) -> None:
        # Per tenant, in the order claimed: the oldest first.
        self._until: dict[str, dict[bytes, float]] = {}
        self._most = most

    def __len__(self) -> int:
        return sum(map(len, self._until.values()))

    async def claim(self, tenant: str, object_id: str, until_wall: float) -> None:
        until = self._until.setdefault(tenant, {})
        name = _digest(tenant, object_id)
        until.pop(name, None)
        until[name] = until_wall
        while len(until) > self._most:
            del until[next(iter(until))]

    async def owns(self, tenant: str, object_id: str, now_wall: float) -> bool:
        until = self._until.get(tenant, {}).get(_digest(tenant, object_id))
        return until is not None and until > now_wall

    async def aclose(self) -> None:
        return None


class RedisOwnedIds:
    """One key per tenant and id, expiring with the claim: nothing to sweep. On the storage's
    link, which the storage closes."""

    def __init__(self, link: RedisLink) -> None:
        self._marks = RedisMarks(link, "stored-object owners")

    async def claim(self, tenant: str, object_id: str, until_wall: float) -> None:
        await self._marks.mark(owner_key(tenant, object_id), until_wall)

    async def owns(self, tenant: str, object_id: str, now_wall: float) -> bool:
        return await self._marks.marked(owner_key(tenant, object_id))

    async def aclose(self) -> None:
        return None


def open_owned_ids(storage: Storage) -> OwnedIds:
    """On `storage`'s Redis link (every replica's), or in this process's memory."""
    return MemoryOwnedIds() if storage.link is None else RedisOwnedIds(storage.link)


def _digest(tenant: str, object_id: str) -> bytes:
    """The pair as one name that no other pair has (a tenant name holds no NUL), of a fixed size
    however long the client's id."""
    return hashlib.sha256(f"{tenant}\0{object_id}".encode(errors="surrogatepass")).digest()


def owner_key(tenant: str, object_id: str) -> str:
    # Its own hash tag: a Redis Cluster spreads the keys over its nodes.
    return "tw:owned:{" + _digest(tenant, object_id).hex() + "}"
