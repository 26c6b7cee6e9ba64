"""A tenant's system prompt sent again is counted from memory, under that tenant's name: a real
gateway, the real Qwen2.5 tokenizer, a quota that needs every prompt counted."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from proxy.app import create_app
from proxy.tokens import segments
from tests.servers import serve
from tests.web.lyingbackend import lying_backend
from tests.web.test_billing import AUTH, billing_policy, ledger_records

SYSTEM = "You answer in the voice of a patient librarian who cites every source. " * 30


def test_a_repeated_system_prompt_is_counted_once_for_its_tenant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    remembered: list[tuple[str, str]] = []
    remember = segments.SegmentMemory._remember

    def spy(self: segments.SegmentMemory, key: tuple[str, str], count: int) -> None:
        remembered.append(key)
        remember(self, key, count)

    monkeypatch.setattr(segments.SegmentMemory, "_remember", spy)
    ledger = tmp_path / "ledger.db"
    with (
        lying_backend() as (_, backend_url),
        serve(create_app(billing_policy(backend_url, ledger))) as url,
    ):
        for question in ("Which atlas?", "Which year?"):
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": question},
            ]
            body = {"model": "exact-llm", "messages": messages}
            answer = httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=10)
            assert answer.status_code == 200
    # Both requests' prompts were counted (the quota reserves them) ...
    first, second = ledger_records(ledger, 2)
    assert first.counted_input_tokens == second.counted_input_tokens > len(SYSTEM) // 10
    # ... the system prompt's piece once, as alpha's; each question's own piece once each.
    system_pieces = [key for key in remembered if SYSTEM in key[1]]
    assert len(system_pieces) == 1
    assert {tenant for tenant, _ in remembered} == {"alpha"}
    assert sum("Which atlas?" in piece for _, piece in remembered) == 1
    assert sum("Which year?" in piece for _, piece in remembered) == 1
