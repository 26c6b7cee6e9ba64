"""What the chaos test checks once its traffic is quiet: the ledger, slots and reservations,
billing against what the backends produced, /metrics against the ledger, the cache's answers."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Sequence

import httpx
import orjson
import redis
from prometheus_client.parser import text_string_to_metric_families

from proxy.cache.answer import Answer
from proxy.ledger.base import UsageRecord
from proxy.ledger.rediskeys import RECORD_FIELD, decode_record
from tests.reliability.chaosnet import PROMPT_TOKENS, RawCounts, Sent, send
from tests.reliability.state import slots_held, tokens_reserved

SETTLE_S = (
    30.0  # a bound on what trails the traffic (buffered records, releases), not a measurement
)


def reset_mock_stats(mock_url: str) -> None:
    httpx.post(mock_url + "/mock/stats/reset").raise_for_status()


def _all_records(redis_url: str) -> list[UsageRecord]:
    with redis.Redis.from_url(redis_url) as client:
        records = []
        for key in client.scan_iter("tw:*"):
            if client.type(key) != b"stream":
                continue
            for _, fields in client.xrange(key):
                if RECORD_FIELD.encode() in fields:
                    records.append(decode_record(fields[RECORD_FIELD.encode()]))
    return [r for r in records if not r.checkpoint]


def settled_ledger(redis_url: str, rids: Sequence[str]) -> dict[str, UsageRecord]:
    """Every final record, by request id, once each of `rids` has one (or AssertionError)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        records = _all_records(redis_url)
        counts = Counter(r.request_id for r in records)
        missing = [rid for rid in rids if counts[rid] == 0]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not missing, f"{len(missing)} requests have no ledger record: {missing[:10]}"
    twice = [rid for rid, n in counts.items() if n > 1]
    assert not twice, f"requests with more than one record: {twice[:10]}"
    return {r.request_id: r for r in records}


def slots_and_reservations_returned(
    url: str, redis_url: str, admin_key: str, daily_tokens: int
) -> None:
    """No slot or reservation left in Redis; /metrics' quota left is the quota less what it
    booked (nothing reserved), and it booked no more than /api/usage billed the tenant (requests
    admitted open while Redis was down are billed, not booked: on_storage_error: open)."""
    deadline = time.monotonic() + SETTLE_S  # releases may trail the ledger's records
    while (slots_held(redis_url), tokens_reserved(redis_url)) != (0, 0):
        if time.monotonic() > deadline:
            raise AssertionError(f"left behind: {_leftovers(redis_url)}")
        time.sleep(0.2)
    with redis.Redis.from_url(redis_url) as client:
        [key] = client.scan_iter("tw:{tight}:q:tokens:d:*")
        booked = int(client.hget(key, "used") or 0)
    headers = {"authorization": f"Bearer {admin_key}"}
    usage = httpx.get(url + "/api/usage?tenant=tight&since=1d", headers=headers).json()
    billed = usage["total"]["input_tokens"] + usage["total"]["output_tokens"]
    left = _samples(url, "tokenweir_budget_remaining_tokens")
    assert left[(("quota", "tokens_per_day"), ("tenant", "tight"))] == daily_tokens - booked
    assert booked <= billed


def _leftovers(redis_url: str) -> dict[str, object]:
    with redis.Redis.from_url(redis_url) as client:
        slots = {
            k: client.zrange(k, 0, -1, withscores=True) for k in client.scan_iter("tw:*:slots")
        }
        reserved = {
            k: client.hgetall(k)
            for k in client.scan_iter("tw:*")
            if client.type(k) == b"hash" and client.hexists(k, "reserved")
        }
    return {"slots": slots, "reserved": reserved}


def billed_within_produced(
    records: dict[str, UsageRecord], sent: Sequence[Sent], raw: RawCounts, mock_url: str
) -> None:
    """No request billed more than its backend wrote plus its prompt; a refused one nothing."""
    mock_billed = 0
    for request in sent:
        record = records[request.rid]
        billed = (record.input_tokens, record.output_tokens, record.cost_nusd)
        if record.usage_source is None or record.status == 429:
            assert billed == (0, 0, 0), record
        prompt = max(PROMPT_TOKENS, record.counted_input_tokens)
        if request.body["model"] == "raw-llm":
            assert record.output_tokens <= raw.written[request.rid], record
        elif request.body["model"] == "mock-llm":
            mock_billed += record.output_tokens
            question = request.body["messages"][-1]["content"]
            prompt = max(len(question.split()) + 4, record.counted_input_tokens)
        assert record.input_tokens <= prompt, record
    stats = httpx.get(mock_url + "/mock/stats").json()
    assert mock_billed <= stats["tokens_sent"]


def _samples(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    text = httpx.get(url + "/metrics").text
    found: dict[tuple[str, ...], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def metrics_match_ledger(url: str, records: dict[str, UsageRecord]) -> None:
    text = httpx.get(url + "/metrics").text
    requests = tokens_in = tokens_out = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tokenweir_requests_total":
                requests += sample.value
            elif sample.name == "gen_ai_client_token_usage_sum":
                if sample.labels["gen_ai_token_type"] == "input":
                    tokens_in += sample.value
                else:
                    tokens_out += sample.value
    ledger = list(records.values())
    assert requests == len(ledger)
    assert tokens_in == sum(r.input_tokens for r in ledger)
    assert tokens_out == sum(r.output_tokens for r in ledger)


def cache_holds_whole_answers(redis_url: str, port: int, sent: Sequence[Sent]) -> None:
    """Each stored answer is whole, and each cacheable question asked again is answered whole."""
    with redis.Redis.from_url(redis_url) as client:
        for key in client.scan_iter("tw:{*}:cache:x:*"):
            answer = Answer.decode(client.get(key) or b"")
            assert answer.finish_reason in ("stop", "length"), answer
            assert answer.message is not None
            assert len(answer.message["content"].split()) == answer.completion_tokens, answer
    asked = {orjson.dumps(s.body, option=orjson.OPT_SORT_KEYS): s for s in sent}
    replays = [
        Sent(f"{s.rid}-replay", s.key, s.body, "never")
        for s in asked.values()
        if s.body["model"] == "mock-llm" and not _faulty(s.body)
    ]
    rng = random.Random(0)  # noqa: S311
    asyncio.run(_replay(port, replays, rng))
    for replay in replays:
        if replay.headers.get("x-tokenweir-cache") != "hit":
            continue
        assert replay.status == 200
        _assert_whole(replay)


async def _replay(port: int, replays: Sequence[Sent], rng: random.Random) -> None:
    for replay in replays:
        await send(port, replay, rng)


def _faulty(body: dict[str, object]) -> bool:
    return any(k in body for k in ("mock_fail", "mock_fail_after_tokens", "mock_delay_ms"))


def _assert_whole(replay: Sent) -> None:
    body = replay.payload()
    if replay.body["stream"]:
        assert body.rstrip().endswith(b"data: [DONE]"), body[-200:]
        assert b'"finish_reason":"stop"' in body or b'"finish_reason":"length"' in body
        return
    answer = orjson.loads(body)
    content = answer["choices"][0]["message"]["content"]
    assert len(content.split()) == answer["usage"]["completion_tokens"], answer
