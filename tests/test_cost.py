"""What requests cost: a ledger record holds the cost its quota booked, at any price a policy
takes."""

from __future__ import annotations

from pathlib import Path

import annotated_types
import httpx
import orjson
from starlette.types import Receive, Scope, Send

from proxy.app import create_app
from proxy.ledger.base import MAX_RECORD_INT
from proxy.policy import parse_policy
from proxy.policy.model import Price
from proxy.policy.units import hash_key
from proxy.stages.usage import MAX_USAGE_TOKENS
from tests.servers import serve

KEY, ADMIN = "tw-test-dear", "tw-test-dear-admin"


def dearest_price_per_1m() -> float:
    """The highest price per million tokens the policy file takes."""
    [bound] = [m for m in Price.model_fields["input_per_1m"].metadata if hasattr(m, "le")]
    assert isinstance(bound, annotated_types.Le)
    return float(bound.le)  # type: ignore[arg-type]


async def most_usage_believed(scope: Scope, receive: Receive, send: Send) -> None:
    """A backend that reports the largest prompt the gateway believes a backend read (with no
    total_tokens, which may be no larger)."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    body = orjson.dumps({
        "id": "c", "object": "chat.completion", "created": 1, "model": "dear",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": MAX_USAGE_TOKENS, "completion_tokens": 1},
    })  # fmt: skip
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def test_at_the_dearest_price_the_ledger_records_what_the_request_cost(tmp_path: Path) -> None:
    """Prices went up to $1 a token: a backend's 3,000,000-token prompt then booked $3,000,001 on
    the tenant's quota and $1,000,000 in the ledger, its record clipped to the most a record
    holds, so reports and the dashboard disagreed with the quota. At the dearest price a policy
    takes now, the most usage the gateway believes fits a record, to the nano-USD."""
    price = dearest_price_per_1m()
    with serve(most_usage_believed) as backend:
        policy = parse_policy(
            f"""
storage: memory
ledger: sqlite:///{tmp_path / "ledger.db"}
admin_keys: [{hash_key(ADMIN)}]
backends: [{{name: b, url: "{backend}/v1", models: [dear]}}]
models:
  dear: {{price: {{input_per_1m: {price}, output_per_1m: {price}}}}}
tenants:
  rich:
    api_keys: [{hash_key(KEY)}]
    models: [dear]
    budget: {{usd_per_day: 9000000000}}
""",
            file="dear.yaml",
        )
        with serve(create_app(policy)) as url:
            answer = httpx.post(
                url + "/v1/chat/completions",
                headers={"authorization": f"Bearer {KEY}"},
                json={"model": "dear", "messages": [{"role": "user", "content": "hi"}]},
            )
            assert answer.status_code == 200, answer.text
            for _ in range(100):
                usage = httpx.get(
                    url + "/api/usage", headers={"authorization": f"Bearer {ADMIN}"}
                ).json()
                if usage["total"]["requests"]:
                    break
    cost_nusd = (MAX_USAGE_TOKENS + 1) * round(price * 1000)  # nano-USD a token
    assert usage["total"]["cost_nusd"] == cost_nusd
    assert cost_nusd <= MAX_RECORD_INT
