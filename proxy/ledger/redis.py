"""The Redis ledger: appends buffered in memory, written by one asyncio task through a Lua script.

Per tenant, a capped stream keeps raw records and hashes keep hour and day totals, all under the
tenant's hash tag. While Redis is unreachable records stay buffered (bounded) and are retried.

On the storage's Redis a gateway's ledger rides on the storage's link (its connections, its
timeout, its Sentinel and Cluster following), which the storage closes after the ledger's last
flush; elsewhere (another Redis, `tokenweir report`) it opens connections of its own.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import uuid
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from importlib import resources
from typing import Any

import orjson
from redis.commands.core import AsyncScript

from proxy.doze import AsyncDoze
from proxy.ledger import query as planner
from proxy.ledger import rediskeys as keys
from proxy.ledger.aggregate import Cell
from proxy.ledger.attribution import is_attribution
from proxy.ledger.base import LedgerError, UsageQuery, UsageRecord, UsageRow
from proxy.ledger.buffer import Batch
from proxy.ledger.taken import TakenBatches
from proxy.ledger.writer import BufferedLedger
from proxy.storage.redis.conn import (
    REDIS_ERRORS,
    Call,
    RedisClient,
    StoreRedis,
    reply_text,
    send_all,
)
from proxy.storage.redis.link import RedisLink
from proxy.storage.redis.resp import Multiplexed, MultiplexedScript

__all__ = ["RedisLedger"]

_log = logging.getLogger("tokenweir.ledger")

_DAY_S = 86400
_RECORD_FIELD = keys.RECORD_FIELD.encode()  # replies are bytes, as on the storage's link
# The writer task holds one; queries (dashboard, /api/usage) the rest, waiting for a free one.
_MAX_CONNECTIONS = 16


@dataclass(frozen=True, slots=True)
class _Connection:
    client: RedisClient
    append: AsyncScript
    sum: AsyncScript


@dataclass(frozen=True, slots=True)
class _Direct:
    """The writer's multiplexed connection to one server (not Sentinel or Cluster), the stores'
    own when on their link: the calls of one turn go out in one write, packed by hiredis."""

    client: Multiplexed
    append: MultiplexedScript


class RedisLedger(BufferedLedger):
    """`append` is a deque append; the task writes every `interval_s` or `batch_records`.
    After an interval with nothing to write it sleeps until a record comes and writes it at
    once; the interval then batches those that follow."""

    def __init__(
        self,
        url: str,
        *,
        link: RedisLink | None = None,
        read_only: bool = False,
        batch_records: int = 500,
        interval_s: float = 0.05,
        buffer_records: int = 100_000,
        flush_timeout_s: float = 10.0,
        stream_records: int = 100_000,
        retention_s: int = 400 * _DAY_S,
        socket_timeout_s: float = 5.0,
    ) -> None:
        self._wake = asyncio.Event()
        self._dozing = AsyncDoze()
        super().__init__(
            read_only=read_only, batch_records=batch_records, buffer_records=buffer_records,
            flush_timeout_s=flush_timeout_s, wake=self._wake, doze=self._dozing,
        )  # fmt: skip
        self.url = url
        self._link = link  # the storage's, on `url`: its owner closes it, after this ledger
        self._owned: StoreRedis | None = None
        self._interval_s = interval_s
        self._stream_records = stream_records
        self._retention_s = retention_s
        self._socket_timeout_s = socket_timeout_s
        self._writer_id = uuid.uuid4().hex
        self._taken = TakenBatches()
        self._connection: _Connection | None = None
        self._direct: _Direct | None = None
        self._task: asyncio.Task[None] | None = None

    def _writer_running(self) -> bool:
        return self._task is not None and not self._task.done()

    def _where(self) -> str:
        return "Redis"

    async def _join_writer(self) -> None:
        if self._task is not None:
            await self._task

    async def _release(self) -> None:
        if self._owned is not None:
            await self._owned.aclose()

    async def start(self) -> None:
        if self._link is not None:
            client, scripts = self._link.client, self._link.scripts
        else:  # its own: redis-py's pool, and a multiplexed writer on one server's URL
            self._owned = StoreRedis(
                self.url,
                timeout_s=self._socket_timeout_s,
                max_connections=_MAX_CONNECTIONS,
                multiplex=not self._read_only,
            )
            client, scripts = self._owned.client, self._owned.scripts
        append, total = (client.register_script(_lua(f)) for f in ("append.lua", "sum.lua"))
        self._connection = _Connection(client, append, total)
        if not self._read_only and isinstance(scripts, Multiplexed):
            self._direct = _Direct(scripts, scripts.register_script(_lua("append.lua")))
        if not self._read_only:
            self._task = asyncio.create_task(self._run(), name="tokenweir-ledger")

    async def query(self, q: UsageQuery) -> list[UsageRow]:
        try:
            cells = await self._read_cells(q)
        except REDIS_ERRORS as exc:
            raise LedgerError(f"cannot read the ledger from Redis: {exc}") from exc
        return planner.rows(q, cells)

    async def latest(self, tenant: str | None, limit: int) -> list[UsageRecord]:
        try:
            tags = [keys.tag(tenant)] if tenant is not None else await self._tags()
            newest = [_newest(keys.stream_key(tenant_tag), limit) for tenant_tag in tags]
            streams = await send_all(self._connected().client, newest)
        except REDIS_ERRORS as exc:
            raise LedgerError(f"cannot read the ledger from Redis: {exc}") from exc
        # Newest written first, as SQLite's row ids have them (a request's record is written
        # when it ends, so not in the order of its `ts`, when it began): each tenant's stream
        # is in that order already, and the tenants' merge by their entries' ids.
        written = [
            (_entry_order(entry), fields[_RECORD_FIELD])
            for entries in streams
            for entry, fields in entries
            if _RECORD_FIELD in fields
        ]
        written.sort(key=operator.itemgetter(0), reverse=True)
        return [keys.decode_record(raw) for _, raw in written[:limit]]

    async def evicting(self) -> str | None:
        """Redis's `maxmemory-policy` unless `noeviction` (a cluster's default node's, or any
        node's where the reply has several): a full Redis under it deletes keys, this ledger's
        records and totals among them."""
        try:
            info = await self._connected().client.info("memory")
        except REDIS_ERRORS as exc:
            raise LedgerError(f"cannot ask Redis its maxmemory-policy: {exc}") from exc
        nodes = [info] if "maxmemory_policy" in info else list(info.values())  # cluster: by node
        policies = {n.get("maxmemory_policy") for n in nodes if isinstance(n, Mapping)}
        return min((str(p) for p in policies if p not in (None, "noeviction")), default=None)

    async def _run(self) -> None:
        while not self._stopping:
            try:  # unless a batch fills, or a flush asks
                async with asyncio.timeout(self._interval_s):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            if not self._has_work():  # a whole interval without a record: doze until one
                await self._dozing.until(self._has_work)  # comes (or close), written at once
            await self._drain()
        await self._drain()  # anything appended after the last flush

    async def _drain(self) -> None:
        attempt = 0
        while (batch := self._buffer.next_batch(self._batch_records)) is not None:
            try:
                await self._write(batch)
            except REDIS_ERRORS as exc:
                delay_s = self._buffer.failed(exc, attempt)
                attempt += 1
                if self._stopping:
                    return
                try:
                    async with asyncio.timeout(delay_s):
                        await self._wake.wait()
                except TimeoutError:
                    pass
                self._wake.clear()
            except Exception as exc:  # a bug in encoding: drop this batch, keep the ledger going
                self._buffer.discard(exc)
            else:
                self._buffer.succeeded()
                attempt = 0

    async def _write(self, batch: Batch) -> None:
        """One round trip: each tenant's share of the batch is one atomic, idempotent script.
        A tenant's share that supersedes checkpoints this Redis has lost (lua/append.lua) is
        sent again, those records superseding nothing: one more round trip, after an outage."""
        by_tenant: defaultdict[str, list[UsageRecord]] = defaultdict(list)
        for record in batch.records:
            by_tenant[keys.tag(record.tenant)].append(record)
        tenants: Sequence[str] = list(by_tenant)  # the tenants' set is written once
        previous = {tenant_tag: self._taken.last(tenant_tag) for tenant_tag in by_tenant}
        while by_tenant:
            replies = await self._append(batch.seq, by_tenant, tenants, previous)
            tenants = ()
            by_tenant = defaultdict(list)
            for (tenant_tag, records), reply in replies:
                if isinstance(reply, list):
                    by_tenant[tenant_tag] = _unlinked(records, {reply_text(link) for link in reply})
                elif (applied := _gap(reply)) is not None:
                    await self._send_again(tenant_tag, applied)
                    by_tenant[tenant_tag] = records
                    previous[tenant_tag] = None
                else:
                    self._taken.took(tenant_tag, batch.seq, records)

    async def _send_again(self, tenant_tag: str, applied: int) -> None:
        """The tenant's batches that Redis took after `applied` and has lost since, each once
        more in order (each with its own seq, so a retry of this applies it once)."""
        kept, whole = self._taken.after(tenant_tag, applied)
        if not whole:
            _log.error(
                "the ledger's Redis lost records it had taken (a failover or a restart) that "
                "this writer no longer holds: some of tenant %s's usage records are lost",
                keys.tenant_of(tenant_tag),
            )
        if kept:
            _log.warning(
                "the ledger's Redis lost %d of tenant %s's records it had taken (a failover or "
                "a restart): written again",
                sum(len(b.records) for b in kept),
                keys.tenant_of(tenant_tag),
            )
        for taken in kept:
            records = taken.records
            while True:
                [(_, reply)] = await self._append(taken.seq, {tenant_tag: records}, (), {})
                if not isinstance(reply, list):
                    break
                records = _unlinked(records, {reply_text(link) for link in reply})

    async def _append(
        self,
        seq: int,
        by_tenant: Mapping[str, list[UsageRecord]],
        tenants: Sequence[str],
        previous: Mapping[str, int | None],
    ) -> list[tuple[tuple[str, list[UsageRecord]], Any]]:
        """Each tenant's append script (checked against the tenant's `previous` batch taken),
        and the set of tenants if `tenants`; each tenant's records with the script's reply."""
        connection = self._connected()
        appends = [
            keys.script_call(
                tenant_tag,
                self._writer_id,
                seq,
                records,
                stream_records=self._stream_records,
                ttl_s=self._retention_s,
                marker_ttl_s=_DAY_S,
                previous=previous.get(tenant_tag),
            )
            for tenant_tag, records in by_tenant.items()
        ]
        # A batch that failed in part is sent again whole: append.lua applies it once per tenant.
        direct = self._direct
        replies: list[Any]
        if direct is not None:  # redis-py's pipeline would send SCRIPT EXISTS every batch
            sends = [direct.append(keys=call_keys, args=args) for call_keys, args in appends]
            if tenants:
                sends.insert(0, direct.client.execute("SADD", keys.TENANTS_KEY, *tenants))
            replies = await asyncio.gather(*sends)
        else:
            calls: list[Call] = [partial(connection.append, *call) for call in appends]
            if tenants:  # no tenant's hash tag: on a cluster it is a command of its own
                calls.insert(0, lambda client: client.sadd(keys.TENANTS_KEY, *tenants))
            replies = await send_all(connection.client, calls)
        return list(zip(by_tenant.items(), replies[len(replies) - len(appends) :], strict=True))

    async def _read_cells(self, q: UsageQuery) -> list[Cell]:
        """Summed in Redis by lua/sum.lua: one small reply per tenant, span and group."""
        connection = self._connected()
        tags = [keys.tag(q.tenant)] if q.tenant is not None else await self._tags()
        spans = planner.plan(q)
        bucket_s = {"hour": 3600, "day": _DAY_S, None: 0}[q.bucket]
        calls: list[Call] = []
        dimension = q.group_by if is_attribution(q) else None
        for tenant_tag in tags:  # one tenant per call: each reads only its own cluster slot
            for span in spans:
                index = keys.index_key(tenant_tag, span.granularity)
                prefix = keys.agg_key(tenant_tag, span.granularity, "")
                group = q.group_by or ""
                if dimension is not None:  # its members are [start, value]: value as 'model'
                    index = keys.attr_index_key(tenant_tag, span.granularity, dimension)
                    prefix = keys.attr_prefix(tenant_tag, span.granularity, dimension)
                    group = "model"
                args: list[str | int] = [span.start, span.end - 1, prefix, bucket_s, group]
                calls.append(partial(connection.sum, [index], args))
        replies = iter(await send_all(connection.client, calls))
        return [
            keys.decode_cell(keys.tenant_of(tenant_tag), group, totals)
            for tenant_tag in tags
            for _ in spans
            for group, totals in orjson.loads(next(replies))
        ]

    async def _tags(self) -> list[str]:
        return sorted(map(reply_text, await self._connected().client.smembers(keys.TENANTS_KEY)))

    def _connected(self) -> _Connection:
        if self._connection is None:
            raise LedgerError("the ledger is not started")
        return self._connection


def _gap(reply: Any) -> int | None:
    """The last seq this Redis applied, when lua/append.lua says it lost batches after it."""
    if isinstance(reply, str | bytes):
        text = reply_text(reply)
        if text.startswith("gap "):
            return int(text[4:])
    return None


def _unlinked(records: list[UsageRecord], lost: set[str]) -> list[UsageRecord]:
    """`records`, those that supersede a checkpoint in `lost` (by link) superseding nothing."""
    if not any(r.supersedes is not None and r.link in lost for r in records):
        raise RuntimeError(f"the ledger script named checkpoints the batch lacks: {lost}")
    return [
        replace(r, supersedes=None) if r.supersedes is not None and r.link in lost else r
        for r in records
    ]


def _entry_order(entry: bytes) -> tuple[int, int]:
    """A stream entry id ("<ms>-<seq>") as numbers, in the order Redis added the entries."""
    ms, _, seq = entry.partition(b"-")
    return int(ms), int(seq or 0)


def _newest(stream: str, limit: int) -> Call:
    return lambda client: client.xrevrange(stream, count=limit)


def _lua(name: str) -> str:
    return resources.files(__package__).joinpath("lua", name).read_text("utf-8")
