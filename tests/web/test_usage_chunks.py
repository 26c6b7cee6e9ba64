"""The usage a backend reports, malformed or not readable as orjson reads JSON: what a client sees
and what the request bills, through a real gateway, the openai SDK as the client and a backend on
127.0.0.1 that answers honestly but sends whatever usage a test sets."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from proxy.app import create_app
from tests.conftest import ALPHA_KEY
from tests.servers import serve
from tests.web.lyingbackend import WORD, WORDS, LyingBackend, lying_backend
from tests.web.test_billing import HELLO, billing_policy, ledger_records

# Usage chunks a backend may send malformed, each mentioning `prompt_tokens` as a usage chunk does.
MALFORMED = [
    b'"garbage", "note": {"prompt_tokens": 9}',  # usage no object
    b'[{"prompt_tokens": 9, "completion_tokens": 12}]',
    b'null, "prompt_tokens": 9',
    b'{"prompt_tokens": 9, "completion_tokens": NaN}',  # no JSON to orjson (nor to RFC 8259)
    b'{"prompt_tokens": 9, "completion_tokens": 12',  # cut short
]


@pytest.fixture
def liar_gateway(tmp_path: Path) -> Iterator[tuple[LyingBackend, str, Path]]:
    ledger = tmp_path / "ledger.db"
    with lying_backend() as (backend, url), serve(create_app(billing_policy(url, ledger))) as gw:
        yield backend, gw, ledger


def _client(gateway: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway + "/v1", api_key=ALPHA_KEY, max_retries=0, timeout=10)


@pytest.mark.parametrize("usage", MALFORMED)
def test_a_malformed_usage_chunk_never_reaches_a_client_that_did_not_ask_for_usage(
    liar_gateway: tuple[LyingBackend, str, Path], usage: bytes
) -> None:
    """The gateway asks the backend for usage on its own behalf: the chunk that answers, whatever
    its shape, is the gateway's. It reached the client (the SDK raised on the event that was no
    JSON, and saw a `usage` string or list it never asked for) and was billed as a token."""
    backend, gateway, ledger = liar_gateway
    backend.usage = usage
    stream = _client(gateway).chat.completions.create(
        model="exact-llm", messages=HELLO, stream=True
    )  # type: ignore[call-overload]
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == WORD * WORDS
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)  # no usage-only chunk, the malformed one included
    [record] = ledger_records(ledger, 1)
    assert (record.usage_source, record.output_tokens) == ("counted", WORDS)


@pytest.mark.parametrize("usage", MALFORMED[:3])
def test_a_malformed_usage_chunk_a_client_asked_for_is_passed_on_and_is_no_token(
    liar_gateway: tuple[LyingBackend, str, Path], usage: bytes
) -> None:
    backend, gateway, ledger = liar_gateway
    backend.usage = usage
    stream = _client(gateway).chat.completions.create(
        model="exact-llm",
        messages=HELLO,
        stream=True,
        stream_options={"include_usage": True},
    )  # type: ignore[call-overload]
    chunks = list(stream)
    assert [c for c in chunks if not c.choices]  # the backend's chunk, as it sent it
    [record] = ledger_records(ledger, 1)
    assert (record.usage_source, record.output_tokens) == ("counted", WORDS)
