"""RediSearch (FT.SEARCH, HNSW) for the semantic cache: one index per tenant and dimension.

A vector lives in a hash beside its entry, `tw:{tenant}:cache:f:<key>` with fields `p` (the
partition in hex, a TAG), `q` (the question) and `v<dimension>` (float32), and expires with the
entry (cache_ft_add.lua copies the entry's remaining TTL; an entry already gone gets no vector).

Isolation is by construction: the tenant's index `tw:{tenant}:cache:idx<dimension>` covers only
keys starting `tw:{tenant}:cache:f:` (tenant names have no braces, so no tenant's prefix starts
another's), and every query is pre-filtered on the partition's TAG. One index per tenant rather
than per partition: partitions are unbounded (one per conversation context) and each index is a
structure of its own in Redis (graph, key prefix, an FT.CREATE), while tenants are the few. On
a Redis Cluster the index and its hashes share the tenant's hash tag, so FT commands go to the
node of its slot.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from proxy.storage.base import StorageError
from proxy.storage.cache import Graph, VectorHit
from proxy.storage.redis.cache_writer import BatchedWriter, Command
from proxy.storage.redis.conn import reply_text as _text
from proxy.storage.redis.conn import translated

__all__ = ["MAX_INDEXES", "RedisSearchVectors", "index_name", "vector_key"]

_log = logging.getLogger("tokenweir.cache")
MAX_INDEXES = 4
"""A tenant's indexes, one per dimension: an embedder swapped for one of another dimension makes
a second. Every index covers all of the tenant's vector hashes, so each hash write is indexed by
each of them: an embedder answering another dimension each time made an index each time (1,000
of them: a write took 5.7 ms, not 68 µs, and Redis held 126 MB more)."""


def index_name(prefix: str, dim: int) -> str:
    return f"{prefix}idx{dim}"


def vector_key(prefix: str, member: str) -> str:
    return f"{prefix}f:{member}"


@dataclass(frozen=True, slots=True)
class _Add:
    prefix: str
    partition: str
    member: str
    vector: bytes
    question: str
    m: int
    ef: int


@dataclass(frozen=True, slots=True)
class _Remove:
    key: str


class RedisSearchVectors(BatchedWriter[_Add | _Remove]):
    name: Literal["search", "vsets"] = "search"
    marker = "#"
    script_name = "cache_ft_add"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._refused: set[str] = set()  # tenants' prefixes at MAX_INDEXES, warned about

    async def available(self) -> bool:
        return await self._probe(partial(_ft, ("FT._LIST",), "tw:{probe}:cache:"))

    async def nearest(
        self, tenant: str, partition: str, query: bytes, *, count: int, ef: int
    ) -> list[VectorHit]:
        prefix = self._prefix_of(tenant)
        dim = len(query) // 4
        name = index_name(prefix, dim)
        knn = f"@p:{{{_tag(partition)}}}=>[KNN $k @v{dim} $vec EF_RUNTIME $ef AS d]"
        command = (
            "FT.SEARCH", name, knn, "PARAMS", 6, "k", count, "vec", query, "ef", ef,
            "SORTBY", "d", "RETURN", 2, "d", "q", "LIMIT", 0, count, "DIALECT", 2,
        )  # fmt: skip
        try:
            with translated("cache storage"):
                found = await _ft(command, prefix, self._client)
        except StorageError as exc:
            if isinstance(exc.__cause__, ResponseError) and _no_index(str(exc)):
                self._prepared.discard(name)  # nothing written yet, or the database was emptied
                return []
            raise
        named = (_named(hit, vector_key(prefix, "")) for hit in _hits(found))
        return [hit for hit in named if hit is not None]

    def add(
        self, tenant: str, partition: str, member: str, vector: bytes, question: str,
        *, graph: Graph, ttl_ms: int, keep_ms: int,
    ) -> None:  # fmt: skip
        # The entry's own TTL is read in Redis when the vector is written: ttl_ms is not needed.
        prefix = self._prefix_of(tenant)
        m, ef = graph.m, graph.ef_construction
        self._enqueue(tenant, _Add(prefix, partition, member, vector, question, m, ef))

    def remove(self, tenant: str, partition: str, key: str) -> None:
        self._enqueue(tenant, _Remove(vector_key(self._prefix_of(tenant), key)))

    async def _before(self, batch: list[_Add | _Remove]) -> list[_Add | _Remove]:
        """Create the indexes this process has not yet seen that the batch writes to; a vector
        that would need a tenant's index past MAX_INDEXES is not written."""
        kept: list[_Add | _Remove] = []
        for write in batch:
            if isinstance(write, _Add):
                name = index_name(write.prefix, len(write.vector) // 4)
                if name not in self._prepared and not await self._prepare(write, name):
                    continue
            kept.append(write)
        return kept

    async def _prepare(self, write: _Add, name: str) -> bool:
        """Create index `name`; False if the tenant has MAX_INDEXES of other dimensions."""
        with translated("cache storage"):
            listed = await _ft(("FT._LIST",), write.prefix, self._client)
        own = {index for index in map(_text, listed) if _is_index_of(write.prefix, index)}
        if name not in own and len(own) >= MAX_INDEXES:
            if write.prefix not in self._refused:
                self._refused.add(write.prefix)
                _log.warning(
                    "the embedder's vectors have had %d dimensions for one tenant; vectors of "
                    "another (%s) are not written to Redis's search",
                    len(own), name,
                )  # fmt: skip
            return False
        dim = len(write.vector) // 4
        schema = (
            "ON", "HASH", "PREFIX", 1, vector_key(write.prefix, ""), "SCHEMA", "p", "TAG",
            f"v{dim}", "VECTOR", "HNSW", 10, "TYPE", "FLOAT32", "DIM", dim,
            "DISTANCE_METRIC", "COSINE", "M", write.m, "EF_CONSTRUCTION", write.ef,
        )  # fmt: skip
        try:
            with translated("cache storage"):
                await _ft(("FT.CREATE", name, *schema), write.prefix, self._client)
        except StorageError as exc:
            if "index already exists" not in str(exc).lower():
                raise
        self._prepared.add(name)
        return True

    def _commands(self, write: _Add | _Remove) -> list[Command]:
        if isinstance(write, _Remove):
            return [("DEL", write.key)]
        keys = [vector_key(write.prefix, write.member), f"{write.prefix}x:{write.member}"]
        dim = len(write.vector) // 4
        args = [_tag(write.partition), write.question, f"v{dim}", write.vector]
        return [self._script(keys, args)]


async def _ft(command: tuple[Any, ...], prefix: str, client: Any) -> Any:
    """An FT command: on a cluster, sent to the node of the tenant's slot (FT commands name no
    key redis-py could route by)."""
    if isinstance(client, RedisCluster):
        await client.initialize()  # the slot map (read once, then kept up to date by redis-py)
        node = client.get_node_from_key(prefix)
        return await client.execute_command(*command, target_nodes=node)
    return await client.execute_command(*command)


def _is_index_of(prefix: str, name: str) -> bool:
    start = index_name(prefix, 0)[:-1]
    return name.startswith(start) and name[len(start) :].isdigit()


def _no_index(message: str) -> bool:
    """RediSearch 2.x says "idx: no such index"; later versions "Unknown index name"."""
    lowered = message.lower()
    return "no such index" in lowered or "unknown index" in lowered


def _tag(partition: str) -> str:
    """The partition as a TAG value: hex digits, which need no escaping in a query and hold no
    separator (a partition "a,b" would otherwise be indexed as the tags "a" and "b")."""
    return partition.encode().hex()


def _hits(found: Any) -> list[tuple[str, dict[str, str]]]:
    """(document id, returned fields) from FT.SEARCH's RESP2 list or RESP3 map."""
    if isinstance(found, dict):
        results: list[Any] = found.get(b"results") or found.get("results") or []
        out = []
        for result in results:
            doc = {_text(k): v for k, v in result.items()}
            fields: dict[Any, Any] = doc.get("extra_attributes") or {}
            out.append((_text(doc["id"]), {_text(k): _text(v) for k, v in fields.items()}))
        return out
    rows = list(found or [])[1:]  # [total, id, [field, value, ...], id, ...]
    pairs = zip(rows[::2], rows[1::2], strict=True)
    return [
        (_text(doc), {_text(k): _text(v) for k, v in zip(f[::2], f[1::2], strict=True)})
        for doc, f in pairs
    ]


def _named(hit: tuple[str, dict[str, str]], vectors: str) -> VectorHit | None:
    doc, fields = hit
    if not doc.startswith(vectors) or "d" not in fields:
        return None
    # COSINE distance is 1 - cosine similarity
    return VectorHit(doc[len(vectors) :], 1.0 - float(fields["d"]), fields.get("q", ""))
