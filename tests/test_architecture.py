"""docs/architecture.md stays true: its stage table is the gateway's stage list, in order, each
in the module it names, and every path it names exists."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from proxy.clock import SystemClock
from proxy.gateway import Gateway
from proxy.policy.units import hash_key
from tests.conftest import make_policy

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "architecture.md"

pytestmark = pytest.mark.anyio


def documented_stages() -> list[tuple[str, str]]:
    """(class name, module path) of each row of the page's stage table."""
    text = PAGE.read_text(encoding="utf-8")
    table = text.split("<!-- stages:")[1].split("<!-- /stages -->")[0]
    return re.findall(r"^\| `(\w+)` \| `([\w/.]+)` \|", table, re.MULTILINE)


async def test_the_stage_table_is_the_gateways_stage_list() -> None:
    # A tenant with a degradation rule: DegradeChoice is in the list only then.
    rule = "[{name: r, when: {}, then: {}}]"
    gamma = f"  gamma: {{api_keys: [{hash_key('tw-x')}], models: [mock-llm], degrade: {rule}}}\n"
    gateway = Gateway.build(make_policy("http://127.0.0.1:9", extra=gamma), SystemClock())
    try:
        built = [
            (type(stage).__name__, str(Path(inspect.getfile(type(stage))).relative_to(ROOT)))
            for stage in gateway.pipeline.stages
        ]
    finally:
        await gateway.aclose()
    assert documented_stages() == built


def test_every_path_the_page_names_exists() -> None:
    text = PAGE.read_text(encoding="utf-8")
    named = set(re.findall(r"(?:proxy|tests|docs)/[\w/.*]*\w/?", text))
    assert len(named) > 20
    missing = sorted(path for path in named if "*" not in path and not (ROOT / path).exists())
    assert missing == []
