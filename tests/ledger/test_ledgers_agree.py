"""SQLite and Redis ledgers, given the same generated records, answer every query alike, and
their plain totals are what the records add up to.

An auditor's check of the two stores the dashboard and /api/usage read: records of a few
tenants over three days (every status, cache outcome, attribution, a request's checkpoints
superseded by its final record), appended in batches that fall anywhere, then every grouping
and bucketing of a few windows asked of both. Attribution runs with a bound of two named values
a period, so values past it are summed under OTHER in both.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import proxy.ledger.attribution as attribution
import proxy.ledger.rediskeys as rediskeys
from proxy.ledger import UsageQuery, UsageRecord
from tests.ledger.factory import DAY_S, HOUR_S, T0, record
from tests.ledger.test_contract import opened

BUCKETS = (None, "hour", "day")
GROUPS = (None, "model", "backend", "key", "user", "tag")
WINDOWS = (
    (T0 - 20 * DAY_S, T0 + 4 * DAY_S),  # starts past the hour cells' retention: whole days
    (T0 + 5 * HOUR_S, T0 + DAY_S + 2 * HOUR_S),
    (T0 + 30 * HOUR_S + 1, T0 + 31 * HOUR_S - 1),  # inside one hour: widened to it
)
_TAGS = st.lists(st.sampled_from(["search", "beta", "ops", "x"]), max_size=3, unique=True)
_SPLIT = st.integers(0, 3)  # 0: a flush after this record (so batches fall anywhere)


@st.composite
def _request(draw: st.DrawFn, n: int) -> list[UsageRecord]:
    """One request's records: 0-2 checkpoints (usage so far), then its final record, each
    superseding the one before, as stages/checkpoint.py and stages/account.py write them."""
    ts = T0 + draw(st.sampled_from([0.0, HOUR_S - 0.001, HOUR_S, DAY_S - 0.5, DAY_S]))
    ts += draw(st.floats(0, 2 * DAY_S, allow_nan=False))
    final = record(
        n,
        ts=ts,
        tenant=draw(st.sampled_from(["alpha", "beta", "客服", None])),
        model=draw(st.sampled_from(["m1", "m2", None])),
        backend=draw(st.sampled_from(["b1", "b2", None])),
        status=draw(st.sampled_from([200, 200, 400, 401, 429, 500, 502])),
        input_tokens=draw(st.integers(0, 10**7)),
        output_tokens=draw(st.integers(0, 10**6)),
        cost_nusd=draw(st.integers(0, 10**13)),
        cache=draw(st.sampled_from(["miss", "hit", "semantic-hit", "bypass"])),
        ttft_ms=draw(st.none() | st.floats(0.01, 10**5)),
        tokens_per_s=draw(st.none() | st.floats(0.01, 10**5)),
        duration_ms=draw(st.floats(0, 10**6)),
        shaped=tuple(draw(st.lists(st.sampled_from(["history", "max_tokens"]), max_size=2))),
        degraded=tuple(draw(st.lists(st.just("shorten-under-load"), max_size=1))),
        client_disconnected=draw(st.booleans()),
        saved_input_tokens=draw(st.integers(0, 10**5)),
        saved_output_tokens=draw(st.integers(0, 10**5)),
        saved_cost_nusd=draw(st.integers(0, 10**9)),
        usage_source=draw(st.sampled_from([None, "backend", "counted", "estimated", "cache"])),
        key_id=draw(st.sampled_from([None, "k1", "k2", "k3"])),
        user=draw(st.sampled_from([None, "ann", "bob", "cy"])),
        tags=tuple(draw(_TAGS)),
    )
    records: list[UsageRecord] = []
    for _ in range(draw(st.integers(0, 2))):
        so_far = min(final.output_tokens, draw(st.integers(1, 10**6)))
        point = replace(
            final, output_tokens=so_far, ttft_ms=None, tokens_per_s=None, checkpoint=True,
            cost_nusd=draw(st.integers(0, 10**9)), usage_source="counted",
            supersedes=records[-1] if records else None,
        )  # fmt: skip
        records.append(point)
    records.append(replace(final, supersedes=records[-1] if records else None))
    return records


@st.composite
def _appends(draw: st.DrawFn) -> list[tuple[UsageRecord, bool]]:
    """Records in the order a gateway appends them (requests interleaved: a request's later
    records come after its earlier ones), each with whether a flush follows it."""
    requests = [draw(_request(n)) for n in range(draw(st.integers(1, 12)))]
    order: list[UsageRecord] = []
    pending = [list(r) for r in requests]
    while pending:
        i = draw(st.integers(0, len(pending) - 1))
        order.append(pending[i].pop(0))
        if not pending[i]:
            pending.pop(i)
    return [(r, draw(_SPLIT) == 0) for r in order]


_QUESTIONS = st.lists(
    st.builds(
        lambda tenant, window, bucket, group: UsageQuery(tenant, *window, bucket, group),
        st.sampled_from([None, "alpha", "客服"]),
        st.sampled_from(WINDOWS),
        st.sampled_from(BUCKETS),
        st.sampled_from(GROUPS),
    ),
    min_size=6,
    max_size=6,
)


async def _answers(
    url: str, appends: list[tuple[UsageRecord, bool]], questions: list[UsageQuery]
) -> dict[Any, Any]:
    async with opened(url) as ledger:
        for one, flush in appends:
            ledger.append(one)
            if flush:
                await ledger.flush()
        await ledger.flush()
        # Every record, in no order: Redis writes a batch's records tenant by tenant, so the
        # order across tenants is the same only down to a batch.
        answers: dict[Any, Any] = {"latest": sorted(await ledger.latest(None, 100), key=repr)}
        for tenant in ("alpha", "客服"):  # a tenant's last written, in the order written
            answers["latest", tenant] = await ledger.latest(tenant, 3)
        for q in [UsageQuery(None, *WINDOWS[0]), *questions]:
            answers[q] = await ledger.query(q)
    return answers


def _totals(appends: list[tuple[UsageRecord, bool]]) -> dict[str | None, tuple[int, ...]]:
    """Per tenant: requests, input and output tokens, cost; each request's last record only."""
    superseded = {id(r.supersedes) for r, _ in appends if r.supersedes is not None}
    sums: dict[str | None, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for r, _ in appends:
        if id(r) not in superseded:
            row = sums[r.tenant]
            row[0] += 1
            row[1] += r.input_tokens
            row[2] += r.output_tokens
            row[3] += r.cost_nusd
    return {tenant: tuple(row) for tenant, row in sums.items()}


@pytest.fixture
def bounded_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two named values a tenant, dimension and period: the rest go under OTHER."""
    monkeypatch.setattr(attribution, "MAX_NAMED", 2)
    monkeypatch.setattr(rediskeys, "MAX_NAMED", 2)


@settings(
    max_examples=50,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(appends=_appends(), questions=_QUESTIONS)
def test_sqlite_and_redis_ledgers_answer_alike(
    appends: list[tuple[UsageRecord, bool]],
    questions: list[UsageQuery],
    redis_url: str,
    tmp_path: Path,
    bounded_names: None,
) -> None:
    with redis.Redis.from_url(redis_url) as admin:
        admin.flushdb()
    database = tmp_path / "ledger.db"
    database.unlink(missing_ok=True)
    sqlite = asyncio.run(_answers(f"sqlite:///{database}", appends, questions))
    on_redis = asyncio.run(_answers(redis_url, appends, questions))
    assert sqlite.keys() == on_redis.keys()
    for question, answer in sqlite.items():
        assert on_redis[question] == answer, question
    everything = UsageQuery(None, *WINDOWS[0])
    rows = sqlite[everything]
    got = {r.tenant: (r.requests, r.input_tokens, r.output_tokens, r.cost_nusd) for r in rows}
    assert got == _totals(appends)
    assert len(sqlite["latest"]) == sum(not r.checkpoint for r, _ in appends)
