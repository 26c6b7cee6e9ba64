"""Redis's own vector search for the semantic cache: one vector set (VADD/VSIM) per partition.

A partition's set is `tw:{tenant}:cache:s:<partition>`, in the tenant's hash tag like its entries,
so isolation is by key name and on a Redis Cluster the set lives in the tenant's slot. Writes are
queued and sent in batches by one background task: storing an answer never waits for the graph.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import orjson
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from proxy.storage.base import StorageError
from proxy.storage.cache import VectorHit
from proxy.storage.redisconn import Call, RedisClient, send_all, translated

__all__ = ["RedisVectorSets", "set_key"]

_log = logging.getLogger("tokenweir.cache")
# Commands per pipeline; a full queue drops new vectors (their answers are still cached exactly).
_BATCH = 64
_QUEUE_LIMIT = 20_000


def set_key(prefix: str, partition: str) -> str:
    return f"{prefix}s:{partition}"


@dataclass(frozen=True, slots=True)
class _Add:
    key: str
    member: str
    vector: bytes
    question: str
    m: int
    ef: int
    keep_ms: int


@dataclass(frozen=True, slots=True)
class _Remove:
    key: str
    member: str


class RedisVectorSets:
    def __init__(self, client: RedisClient, prefix_of: Callable[[str], str]) -> None:
        self._client = client
        self._prefix_of = prefix_of
        self._available: bool | None = None
        self._queue: deque[_Add | _Remove] = deque()
        self._writer: asyncio.Task[None] | None = None

    async def available(self) -> bool:
        if self._available is None:
            try:
                with translated("cache storage"):
                    await self._client.execute_command("VCARD", "tw:{probe}:cache:s:-")
                self._available = True
            except StorageError as exc:
                if isinstance(exc.__cause__, RedisConnectionError | RedisTimeoutError | OSError):
                    raise  # Redis unreachable: ask again next time
                # "unknown command" (Redis before 8; redis-py's cluster client says it itself)
                self._available = False
        return self._available

    async def nearest(
        self, tenant: str, partition: str, query: bytes, *, count: int, ef: int
    ) -> list[VectorHit]:
        key = set_key(self._prefix_of(tenant), partition)
        command = ("VSIM", key, "FP32", query, "WITHSCORES", "WITHATTRIBS", "COUNT", count)
        with translated("cache storage"):
            found = await self._client.execute_command(*command, "EF", ef)
        return [_hit(member, scored) for member, scored in (found or {}).items()]

    def add(
        self, tenant: str, partition: str, member: str, vector: bytes, question: str,
        *, m: int, ef: int, keep_ms: int,
    ) -> None:  # fmt: skip
        key = set_key(self._prefix_of(tenant), partition)
        self._enqueue(_Add(key, member, vector, question, m, ef, keep_ms))

    def remove(self, tenant: str, partition: str, key: str) -> None:
        self._enqueue(_Remove(set_key(self._prefix_of(tenant), partition), key))

    def pending(self) -> int:
        return len(self._queue)

    async def flush(self) -> None:
        """Wait until every queued write has been sent (tests, shutdown)."""
        while self._writer is not None and not self._writer.done():
            await asyncio.shield(self._writer)

    async def aclose(self) -> None:
        try:
            async with asyncio.timeout(2.0):
                await self.flush()
        except (TimeoutError, StorageError):
            _log.warning("%d semantic cache vectors not written at shutdown", len(self._queue))
        if self._writer is not None:
            self._writer.cancel()
            await asyncio.gather(self._writer, return_exceptions=True)

    def _enqueue(self, write: _Add | _Remove) -> None:
        if len(self._queue) >= _QUEUE_LIMIT:
            return
        self._queue.append(write)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write())

    async def _write(self) -> None:
        while self._queue:
            batch = [self._queue.popleft() for _ in range(min(_BATCH, len(self._queue)))]
            calls: list[Call] = []
            for write in batch:
                calls.extend(_commands(write))
            try:
                with translated("cache storage"):
                    await send_all(self._client, calls)
            except StorageError as exc:
                _log.warning("could not write %d semantic cache vectors: %s", len(batch), exc)


def _commands(write: _Add | _Remove) -> list[Call]:
    if isinstance(write, _Remove):
        return [partial(_run, ("VREM", write.key, write.member))]
    attributes = orjson.dumps({"q": write.question})
    # CAS: the graph's neighbour search runs in a Redis thread, lookups are not held up by it.
    vadd = ("VADD", write.key, "FP32", write.vector, write.member, "CAS", "NOQUANT")
    options = ("SETATTR", attributes, "M", write.m, "EF", write.ef)
    return [partial(_run, vadd + options), partial(_run, ("PEXPIRE", write.key, write.keep_ms))]


def _run(command: tuple[Any, ...], client: Any) -> Any:
    return client.execute_command(*command)


def _hit(member: Any, scored: Any) -> VectorHit:
    score, attributes = scored if isinstance(scored, list | tuple) else (scored, None)
    question = orjson.loads(attributes).get("q", "") if attributes else ""
    name = member.decode() if isinstance(member, bytes) else str(member)
    # VSIM's score is (1 + cosine) / 2
    return VectorHit(name, 2.0 * float(score) - 1.0, question)
