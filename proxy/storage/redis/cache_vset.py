"""Redis's own vector search for the semantic cache: one vector set (VADD/VSIM) per partition.

A partition's set is `tw:{tenant}:cache:s:<partition>`, in the tenant's hash tag like its entries,
so isolation is by key name and on a Redis Cluster the set lives in the tenant's slot. Writes are
queued and sent in paced batches by one background task: storing an answer never waits for the
graph, and a vector whose entry is gone by the time it is written is removed again.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import orjson
from redis.exceptions import ResponseError

from proxy.storage.base import StorageError
from proxy.storage.cache import Graph, VectorHit
from proxy.storage.redis.cache_writer import BatchedWriter, Command, run
from proxy.storage.redis.conn import reply_text, translated

__all__ = ["RedisVectorSets", "set_key"]


def set_key(prefix: str, partition: str) -> str:
    return f"{prefix}s:{partition}"


@dataclass(frozen=True, slots=True)
class _Add:
    key: str
    entry: str
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


class RedisVectorSets(BatchedWriter[_Add | _Remove]):
    name: Literal["search", "vsets"] = "vsets"
    marker = "*"
    script_name = "cache_vset_check"

    async def available(self) -> bool:
        return await self._probe(partial(run, ("VCARD", "tw:{probe}:cache:s:-")))

    async def nearest(
        self, tenant: str, partition: str, query: bytes, *, count: int, ef: int
    ) -> list[VectorHit]:
        key = set_key(self._prefix_of(tenant), partition)
        command = ("VSIM", key, "FP32", query, "WITHSCORES", "WITHATTRIBS", "COUNT", count)
        try:
            with translated("cache storage"):
                found = await self._client.execute_command(*command, "EF", ef)
        except StorageError as exc:
            # The set holds another dimension's vectors (the embedder changed): nothing near.
            if isinstance(exc.__cause__, ResponseError) and "dimension mismatch" in str(exc):
                return []
            raise
        return [_hit(member, scored) for member, scored in (found or {}).items()]

    def add(
        self, tenant: str, partition: str, member: str, vector: bytes, question: str,
        *, graph: Graph, ttl_ms: int, keep_ms: int,
    ) -> None:  # fmt: skip
        prefix = self._prefix_of(tenant)
        key, entry = set_key(prefix, partition), f"{prefix}x:{member}"
        m, ef = graph.m, graph.ef_construction
        self._enqueue(tenant, _Add(key, entry, member, vector, question, m, ef, keep_ms))

    def remove(self, tenant: str, partition: str, key: str) -> None:
        self._enqueue(tenant, _Remove(set_key(self._prefix_of(tenant), partition), key))

    def _commands(self, write: _Add | _Remove) -> list[Command]:
        if isinstance(write, _Remove):
            return [("VREM", write.key, write.member)]
        attributes = orjson.dumps({"q": write.question})
        # CAS: the graph's neighbour search runs in a Redis thread, lookups are not held up by it.
        vadd = ("VADD", write.key, "FP32", write.vector, write.member, "CAS", "NOQUANT")
        options = ("SETATTR", attributes, "M", write.m, "EF", write.ef)
        return [
            vadd + options,
            ("PEXPIRE", write.key, write.keep_ms),
            self._script([write.key, write.entry], [write.member]),
        ]


def _hit(member: Any, scored: Any) -> VectorHit:
    score, attributes = scored if isinstance(scored, list | tuple) else (scored, None)
    question = orjson.loads(attributes).get("q", "") if attributes else ""
    name = reply_text(member)
    # VSIM's score is (1 + cosine) / 2
    return VectorHit(name, 2.0 * float(score) - 1.0, question)
