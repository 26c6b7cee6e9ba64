"""docs/usage.md's "Access log" names every field of a real access line, and names none that is
not there (`log_content: true`, so the prompt and completion are in it too)."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import orjson
import pytest

from proxy.app import create_app
from tests.conftest import ALPHA_KEY, make_policy
from tests.servers import serve
from tests.telemetry.test_docs_metrics import stream_chat

PAGE = Path(__file__).resolve().parents[2] / "docs" / "usage.md"
# Named in the section, but not fields: a choice count and a Responses answer's item type.
_NOT_FIELDS = {"n", "output_text"}
_WAIT_S = 30.0  # a limit on a loaded machine, not a measurement


def _documented() -> set[str]:
    text = PAGE.read_text(encoding="utf-8")
    section = text[text.index("## Access log") :]
    return set(re.findall(r"`([a-z][a-z0-9_]*)`", section)) - _NOT_FIELDS


def test_the_access_log_fields_are_the_documented_ones(
    backend_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    with serve(create_app(make_policy(backend_url, extra="log_content: true\n"))) as url:
        stream_chat(url, ALPHA_KEY)
        deadline = time.monotonic() + _WAIT_S
        while not (lines := [r for r in caplog.records if r.name == "tokenweir.access"]):
            assert time.monotonic() < deadline, "no access line was written"
            time.sleep(0.05)
    fields = set(orjson.loads(lines[0].getMessage()))
    documented = _documented()
    assert fields - documented == set(), "written but not in docs/usage.md's Access log"
    assert documented - fields == set(), "in docs/usage.md's Access log but never written"
