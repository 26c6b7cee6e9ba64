"""The gateway's figures judged against a backend whose every byte and pause the test wrote."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.app import create_app
from tests.conftest import ALPHA_KEY, make_policy
from tests.servers import serve
from tests.telemetry.scripted import Script, scripted_backend

SCRIPTS: dict[str, Script] = {
    "backend-rate-limited": (429, {"message": "Rate limit reached", "type": "requests",
                                   "code": "rate_limit_exceeded"}),
    "backend-out-of-credit": (429, {"message": "You exceeded your current quota",
                                    "type": "insufficient_quota", "code": "insufficient_quota"}),
}  # fmt: skip


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    with (
        serve(scripted_backend(SCRIPTS)) as backend_url,
        serve(create_app(make_policy(backend_url))) as url,
    ):
        yield url


def counters(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of counter `name` on `/metrics`, by their labels."""
    families = text_string_to_metric_families(httpx.get(url + "/metrics").text)
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in families
        for sample in family.samples
        if sample.name == name + "_total"
    }


@pytest.mark.parametrize("script", ["backend-rate-limited", "backend-out-of-credit"])
def test_a_backends_429_is_no_rejection_of_the_gateways(gateway: str, script: str) -> None:
    """`tokenweir_rejected_requests_total` counts the tenant's rate limit and budget: a backend
    that refuses (its own rate limit, its account out of credit) is passed on as a 429 with its
    own code, and is no more the tenant's budget than any other backend error."""
    with openai.OpenAI(base_url=gateway + "/v1", api_key=ALPHA_KEY, max_retries=0) as sdk:
        with pytest.raises(openai.RateLimitError):
            sdk.chat.completions.create(
                model="mock-llm", messages=[{"role": "user", "content": script}]
            )
    requests = counters(gateway, "tokenweir_requests")
    assert sum(v for k, v in requests.items() if ("status_class", "4xx") in k) >= 1
    assert counters(gateway, "tokenweir_rejected_requests") == {}
