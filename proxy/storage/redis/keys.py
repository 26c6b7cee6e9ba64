"""Runtime keys on Redis, shared by every replica: one hash of records and a version counter,
both under one hash tag (`tw:{keys}`) so one script changes them together on a cluster too.

Every replica reads the version twice a second: on a one-server URL through a multiplexed
connection (proxy/storage/redis/resp.py), a third of redis-py's CPU a read (about 120 against
370 µs of an idle gateway's, where each read runs cold)."""

from __future__ import annotations

from proxy.storage.redis.conn import translated
from proxy.storage.redis.link import RedisLink
from proxy.storage.redis.lua import script_text
from proxy.storage.redis.resp import Multiplexed

__all__ = ["RedisKeyStore"]

_RECORDS = "tw:{keys}:records"
_VERSION = "tw:{keys}:version"


class RedisKeyStore:
    """On the storage's link in a gateway (its owner closes it), or on a link of its own, given
    a URL (a tool's, a test's). The writes and the version's poll go over the link's multiplexed
    connection where it has one; reading every record, through redis-py's pool (as everything on
    Sentinel and Cluster URLs)."""

    shared = True  # every replica changes it: each polls the version

    def __init__(self, link: str | RedisLink, *, timeout_s: float = 1.0) -> None:
        self._own = isinstance(link, str)  # then closed with the store
        if isinstance(link, str):
            link = RedisLink(link, timeout_s=timeout_s, max_connections=8)
        self._link = link
        self._client = link.client
        scripts = link.scripts
        self._write = scripts.register_script(script_text("keys_write"))
        self._multiplexed = scripts if isinstance(scripts, Multiplexed) else None

    async def put(self, key_id: str, record: bytes) -> None:
        with translated("key storage"):
            await self._write(keys=[_RECORDS, _VERSION], args=["put", key_id, record])

    async def delete(self, key_id: str) -> bool:
        with translated("key storage"):
            removed = await self._write(keys=[_RECORDS, _VERSION], args=["delete", key_id])
        return bool(removed)

    async def records(self) -> dict[str, bytes]:
        # Through redis-py's pool: a bulk read never sits before the multiplexed admissions.
        with translated("key storage"):
            found = await self._client.hgetall(_RECORDS)
        return {_text(k): v if isinstance(v, bytes) else str(v).encode() for k, v in found.items()}

    async def version(self) -> int:
        with translated("key storage"):
            if self._multiplexed is not None:
                value = await self._multiplexed.execute("GET", _VERSION)
            else:
                value = await self._client.get(_VERSION)
        return int(value or 0)

    async def aclose(self) -> None:
        if self._own:
            await self._link.aclose()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
