"""The numbers of a client's request as the backend gets them, through a real gateway (the openai
SDK as the client, a backend on 127.0.0.1 that keeps the bytes it was sent)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from proxy.app import create_app
from tests.conftest import ALPHA_KEY
from tests.servers import serve
from tests.web.lyingbackend import LyingBackend, lying_backend
from tests.web.test_billing import HELLO, billing_policy

BIG = 2**64  # one past what orjson reads as an integer
HUGE = 123456789012345678901234567890
LOW = -(2**63) - 1


@pytest.fixture
def liar_gateway(tmp_path: Path) -> Iterator[tuple[LyingBackend, str]]:
    ledger = tmp_path / "ledger.db"
    with lying_backend() as (backend, url), serve(create_app(billing_policy(url, ledger))) as gw:
        yield backend, gw


def _client(gateway: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway + "/v1", api_key=ALPHA_KEY, max_retries=0, timeout=10)


def test_integers_past_64_bits_reach_the_backend_as_the_client_wrote_them(
    liar_gateway: tuple[LyingBackend, str],
) -> None:
    """orjson reads an integer past 64 bits as the nearest float, and the gateway wrote that
    float to the backend: 2**64 in an unknown field arrived as 1.8446744073709552e+19, so a
    backend's seed, id or schema bound was not the client's."""
    backend, gateway = liar_gateway
    schema = {"type": "integer", "minimum": LOW, "maximum": HUGE}
    tool = {"type": "function", "function": {"name": "pick", "parameters": schema}}
    extra = {
        "sampler_seed": BIG,
        "ids": [BIG, HUGE, LOW, 2**64 - 1, 7],
        "floats": [1.0, -0.0, 0.5, 1e300],
        "note": "C++ at 1.8446744073709552e+19",
    }
    _client(gateway).chat.completions.create(
        model="exact-llm", messages=HELLO, tools=[tool], extra_body=extra
    )  # type: ignore[list-item]
    sent = backend.last_body
    assert b"e+19" not in sent.replace(b'1.8446744073709552e+19"', b"")
    received = json.loads(sent)
    assert received["sampler_seed"] == BIG
    assert received["ids"] == [BIG, HUGE, LOW, 2**64 - 1, 7]
    assert received["tools"][0]["function"]["parameters"] == schema
    assert re.search(rb'"floats":\[1\.0,-0\.0,0\.5,1e\+?300\]', sent)
    assert received["note"] == extra["note"]
