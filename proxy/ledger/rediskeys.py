"""The Redis ledger's key names and encodings: pure functions, so they are testable offline.

Every key of one tenant carries the hash tag `{<tenant>}` and so lives in one Redis Cluster slot,
which is what lets one Lua script update a tenant's records and aggregates atomically.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote, unquote

import orjson

from proxy.ledger import histogram
from proxy.ledger.aggregate import COUNTERS, Cell, CellKey, Granularity, Tally
from proxy.ledger.attribution import HOUR_RETENTION_S, MAX_NAMED, OTHER, AttrKey, fold
from proxy.ledger.base import ATTRIBUTES, UsageRecord, record_values

__all__ = [
    "TENANTS_KEY",
    "agg_key",
    "attr_index_key",
    "attr_prefix",
    "decode_cell",
    "decode_record",
    "index_key",
    "script_call",
    "stream_key",
    "tag",
    "tenant_of",
]

TENANTS_KEY = "tw:ledger:tenants"
"""Set of the tags of every tenant with records: how a query over all tenants finds them. It
carries no tenant's hash tag, so on a Redis Cluster it has a slot of its own: it is only ever
read or written by a command of its own, never inside a tenant's script."""

RECORD_FIELD = "v1"
"""The stream field holding a record: a new layout gets a new name, old entries stay legible."""

_ANONYMOUS = "%anon"  # never produced by quote(): it leaves no '%' without two hex digits
_TTFT = "ttft:"
_SPEED = "tps:"
_CARRY = "^"  # see lua/append.lua: a counter past int64


def tag(tenant: str | None) -> str:
    """The tenant as it appears in keys: percent-encoded, so `{`, `}` and `:` cannot leak."""
    return _ANONYMOUS if tenant is None else quote(tenant, safe="")


def tenant_of(tenant_tag: str) -> str | None:
    return None if tenant_tag == _ANONYMOUS else unquote(tenant_tag)


def stream_key(tenant_tag: str) -> str:
    return f"tw:{{{tenant_tag}}}:ledger:records"


def index_key(tenant_tag: str, granularity: Granularity) -> str:
    return f"tw:{{{tenant_tag}}}:ledger:{granularity}s"


def agg_key(tenant_tag: str, granularity: Granularity, member: str) -> str:
    return f"tw:{{{tenant_tag}}}:ledger:{granularity}:{member}"


def checkpoints_key(tenant_tag: str) -> str:
    """Hash: a running request's checkpoint (its `link`) -> its entry in the record stream."""
    return f"tw:{{{tenant_tag}}}:ledger:checkpoints"


def marker_key(tenant_tag: str, writer_id: str) -> str:
    return f"tw:{{{tenant_tag}}}:ledger:writer:{writer_id}"


def member(start: int, model: str | None, backend: str | None) -> str:
    """An aggregate's name in its index: JSON, so any model or backend name round-trips."""
    return orjson.dumps([start, model, backend]).decode()


def encode_record(record: UsageRecord) -> bytes:
    """A JSON array in UsageRecord's field order (stream field RECORD_FIELD names the layout)."""
    return orjson.dumps(record_values(record))


def decode_record(raw: str | bytes) -> UsageRecord:
    values = orjson.loads(raw)
    for names in (16, 17, 26):
        if names < len(values):  # an entry written before attribution has no tags
            values[names] = tuple(values[names])
    return UsageRecord(*values)


def script_call(
    tenant_tag: str,
    writer_id: str,
    seq: int,
    records: Sequence[UsageRecord],
    *,
    stream_records: int,
    ttl_s: int,
    marker_ttl_s: int,
    previous: int | None = None,
) -> tuple[list[str], list[str | int | bytes]]:
    """KEYS and ARGV for lua/append.lua: one tenant's records and their hour and day totals;
    `previous`, the seq of the writer's last batch for the tenant that Redis took, if known."""
    keys = [
        marker_key(tenant_tag, writer_id),
        stream_key(tenant_tag),
        index_key(tenant_tag, "hour"),
        index_key(tenant_tag, "day"),
        checkpoints_key(tenant_tag),
    ]
    cutoff = int(max(r.ts for r in records)) - ttl_s
    args: list[str | int | bytes] = [seq, stream_records, ttl_s, marker_ttl_s, cutoff]
    args.append(len(records))
    for r in records:
        args += [_checkpoint_link(r), encode_record(r)]
    hours, days, attr_hours, attr_days = fold(records)
    levels: tuple[tuple[int, Granularity, dict[CellKey, Tally]], ...] = (
        (3, "hour", hours),
        (4, "day", days),
    )
    for slot, granularity, tallies in levels:
        for (_, start, model, backend), tally in tallies.items():
            name = member(start, model, backend)
            keys.append(agg_key(tenant_tag, granularity, name))
            fields = _fields(tally)
            args += [slot, name, start, len(fields) // 2, *fields]
    _attribution_call(tenant_tag, records, ttl_s, keys, args, attr_hours, attr_days)
    args.append("" if previous is None else previous)
    return keys, args


def attr_index_key(tenant_tag: str, granularity: Granularity, dimension: str) -> str:
    return f"tw:{{{tenant_tag}}}:ledger:{granularity}s:{dimension}"


def attr_prefix(tenant_tag: str, granularity: Granularity, dimension: str) -> str:
    """Before `names:<period>` (the set of values kept by name), or an aggregate's member."""
    return f"tw:{{{tenant_tag}}}:ledger:{granularity}:{dimension}:"


def _attribution_call(
    tenant_tag: str,
    records: Sequence[UsageRecord],
    ttl_s: int,
    keys: list[str],
    args: list[str | int | bytes],
    hours: dict[AttrKey, Tally],
    days: dict[AttrKey, Tally],
) -> None:
    """The last KEYS are the six attribution indexes; ARGV ends with their cells (`hours`
    and `days`, folded), capped by the script (see proxy.ledger.attribution)."""
    newest = int(max(r.ts for r in records))
    hour_ttl = int(HOUR_RETENTION_S)
    first = len(keys) + 1
    slots: dict[tuple[Granularity, str], int] = {}
    for granularity in ("hour", "day"):
        for dimension in ATTRIBUTES:
            slots[granularity, dimension] = first + len(slots)
            keys.append(attr_index_key(tenant_tag, granularity, dimension))
    args += [newest - hour_ttl, hour_ttl, newest - ttl_s, ttl_s, MAX_NAMED, OTHER]
    cells = [*(("hour", k, t) for k, t in hours.items()), *(("day", k, t) for k, t in days.items())]
    args.append(len(cells))
    for granularity, (_, start, dimension, value), tally in cells:
        fields = _fields(tally)
        prefix = attr_prefix(tenant_tag, granularity, dimension)  # type: ignore[arg-type]
        slot = slots[granularity, dimension]  # type: ignore[index]
        args += [slot, prefix, value, start, len(fields) // 2, *fields]


def _checkpoint_link(record: UsageRecord) -> str:
    """'' for most records; else '<supersedes 0|1><is a checkpoint 0|1><link>' (a request's
    records share one link): see lua/append.lua."""
    superseding = record.supersedes is not None
    if not superseding and not record.checkpoint:
        return ""
    return f"{int(superseding)}{int(record.checkpoint)}{record.link}"


def _fields(tally: Tally) -> list[str | int]:
    fields: list[str | int] = []
    for name, value in zip(COUNTERS, tally.counters(), strict=True):
        if value:
            fields += [name, value]
    for prefix, counts in ((_TTFT, tally.ttft_ms), (_SPEED, tally.tokens_per_s)):
        for index, count in counts.items():
            fields += [f"{prefix}{index}", count]
    return fields


def decode_cell(tenant: str | None, group: list[Any], fields: Mapping[str, int]) -> Cell:
    """A cell as lua/sum.lua replies: `group` is [period or bucket start, model, backend]."""
    start, model, backend = group
    exact: dict[str, int] = {}
    for name, value in fields.items():  # `<name>^` counts 10**18s carried out of `<name>`
        carried = name.endswith(_CARRY)
        name = name.removesuffix(_CARRY)
        exact[name] = exact.get(name, 0) + (value * 10**18 if carried else value)
    ttft: histogram.Histogram = {}
    speed: histogram.Histogram = {}
    for name, value in exact.items():
        if name.startswith(_TTFT):
            ttft[int(name[len(_TTFT) :])] = value
        elif name.startswith(_SPEED):
            speed[int(name[len(_SPEED) :])] = value
    counters = (exact.get(name, 0) for name in COUNTERS)
    return Cell((tenant, start, model, backend), Tally.from_counters(counters, ttft, speed))
