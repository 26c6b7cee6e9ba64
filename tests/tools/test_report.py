"""`tokenweir report` on a real SQLite ledger: table, CSV, JSON, and errors a user can act on."""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import redis

from proxy.clock import FakeClock
from proxy.ledger import open_ledger
from proxy.tools.report import (
    ReportError,
    _ledger_location,
    add_arguments,
    format_usd,
    main,
    parse_time,
    text_width,
)
from tests.ledger.factory import DAY_S, HOUR_S, T0, record

NOW = T0 + 2 * HOUR_S + 60
POLICY = """
backends: [{{name: b, url: "http://127.0.0.1:1/v1", models: [mock-llm]}}]
models: {{mock-llm: {{}}}}
tenants: {{alpha: {{api_keys: ["sha256:{key}"], models: [mock-llm]}}}}
{extra}
"""


@pytest.fixture
def ledger_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    records = [
        record(1, tenant="support-bot", input_tokens=1000, output_tokens=200, cost_nusd=180_000),
        record(2, tenant="support-bot", status=429, input_tokens=0, output_tokens=0, cost_nusd=0),
        record(3, tenant="客服机器人", model="mock-small", cache="hit", cost_nusd=1_234_567_890),
        record(4, tenant=None, model=None, backend=None, status=401, cost_nusd=0),
        record(5, tenant="support-bot", ts=T0 - 10 * DAY_S),  # outside the default 7 days
    ]

    async def write() -> None:
        ledger = open_ledger(url)
        await ledger.start()
        for r in records:
            ledger.append(r)
        await ledger.aclose()

    asyncio.run(write())
    return url


def run(*argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = io.StringIO()
    status = main(parser.parse_args(argv), clock=FakeClock(NOW), out=out)
    return status, out.getvalue()


def write_policy(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY.format(key="0" * 64, extra=extra), encoding="utf-8")
    return path


def test_table_aligns_chinese_tenant_names(ledger_url: str) -> None:
    status, out = run("--ledger", ledger_url)
    assert status == 0
    title, header, *lines = out.splitlines()
    assert title == f"Usage 2027-01-08 10:00 to 2027-01-15 11:00 UTC, ledger {ledger_url}"
    assert header == (
        "tenant             requests  errors  input tokens  output tokens  cost (USD)  cache hits"
    )
    assert [line.split()[0] for line in lines] == [
        "support-bot",
        "客服机器人",
        "(unauthenticated)",
        "total",
    ]
    assert len({text_width(line) for line in [header, *lines]}) == 1  # numbers right-aligned
    assert lines[0].split()[1:] == ["2", "1", "1,000", "200", "0.000180", "0"]
    assert lines[1].split()[1:] == ["1", "0", "100", "50", "1.234568", "1"]
    assert lines[3].split()[1:] == ["4", "2", "1,200", "300", "1.234748", "1"]
    assert len({tuple(cell_ends(line)[-6:]) for line in [header, *lines]}) == 1


def cell_ends(line: str) -> list[int]:
    """The display column where each cell ends (cells are separated by two or more spaces)."""
    return [text_width(line[: m.end()]) for m in re.finditer(r"\S+(?: \S+)*", line)]


def test_csv_has_one_row_per_tenant_with_exact_cost(ledger_url: str) -> None:
    status, out = run("--ledger", ledger_url, "--format", "csv")
    assert status == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [r["tenant"] for r in rows] == ["support-bot", "客服机器人", ""]
    assert rows[0]["requests"] == "2"
    assert rows[0]["rate_limited"] == "1"
    assert rows[1]["cost_usd"] == "1.234568"
    assert rows[1]["cost_nusd"] == "1234567890"
    assert rows[1]["cache_hit_rate"] == "1.0"
    assert rows[2]["ttft_ms_p50"] != ""


def test_json_by_model(ledger_url: str) -> None:
    status, out = run("--ledger", ledger_url, "--format", "json", "--by", "model")
    assert status == 0
    document = orjson.loads(out)
    assert document["since"] == "2027-01-08T10:00:00+00:00"
    assert document["until"] == "2027-01-15T11:00:00+00:00"
    first, second, third = document["rows"]
    assert (first["tenant"], first["model"], first["requests"]) == ("support-bot", "mock-llm", 2)
    assert (second["tenant"], second["model"], second["cost_usd"]) == (
        "客服机器人",
        "mock-small",
        1.234568,
    )
    assert (third["tenant"], third["model"], third["errors"]) == (None, None, 1)


def test_tenant_and_window_flags(ledger_url: str) -> None:
    status, out = run("--ledger", ledger_url, "--tenant", "support-bot", "--since", "30d")
    assert status == 0
    (line,) = out.splitlines()[2:]
    assert line.split()[:2] == ["support-bot", "3"]
    status, out = run("--ledger", ledger_url, "--since", "2027-01-15T09:00", "--until", "1h")
    assert "No usage recorded in this window." in out


def test_missing_ledger_is_not_created(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "nope.db"
    assert run("--ledger", f"sqlite:///{path}")[0] == 1
    assert f"there is no ledger database at {path}" in capsys.readouterr().err
    assert not path.exists()


def test_a_ledger_url_redis_py_cannot_use_is_explained(capsys: pytest.CaptureFixture[str]) -> None:
    """It was a TypeError traceback from redis-py's connection, at the first call."""
    assert run("--ledger", "redis://:hunter2@127.0.0.1:9/0?sockettimeout=1")[0] == 1
    err = capsys.readouterr().err
    assert "takes no option 'sockettimeout'" in err
    assert "hunter2" not in err


def test_policy_names_the_ledger(tmp_path: Path, ledger_url: str) -> None:
    policy = write_policy(tmp_path, f"ledger: {ledger_url}")
    status, out = run("--config", str(policy), "--format", "csv")
    assert status == 0
    assert len(out.splitlines()) == 4


def test_policy_without_ledger_says_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run("--config", str(write_policy(tmp_path, "")))[0] == 1
    err = capsys.readouterr().err
    assert "has no ledger: key" in err
    assert "--ledger URL" in err


def test_a_policy_whose_ledger_cannot_be_read_is_reported(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.delenv("TW_TEST_NO_LEDGER", raising=False)
    config = write_policy(tmp_path, "ledger: ${TW_TEST_NO_LEDGER}")
    assert run("--config", str(config))[0] == 1
    err = capsys.readouterr().err
    assert "cannot read the ledger setting from the policy" in err
    assert "TW_TEST_NO_LEDGER" in err
    assert "pass --ledger URL" in err


def test_ledger_redis_means_the_policys_storage(tmp_path: Path) -> None:
    extra = "storage: redis://127.0.0.1:6379/0\nledger: redis"
    location = _ledger_location(None, write_policy(tmp_path, extra))
    assert location == ("redis", "redis://127.0.0.1:6379/0")


@pytest.mark.parametrize(
    ("argv", "message", "status"),
    [
        (["--since", "1h", "--until", "2h"], "must be before --until", 2),
        (["--since", "yesterday"], "--since: expected a duration like 7d", 2),
        (["--since", "0001-01-01T00:00+23:59"], "--since: expected a moment from 1970-01-01", 2),
        (["--ledger", "postgres://x"], "unknown ledger 'postgres://x'", 1),
    ],
)
def test_bad_flags_are_explained(
    argv: list[str], message: str, status: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """A window that cannot be is a usage error (2) as in every command; a ledger that cannot
    be read is a failure (1), whether --ledger or the policy named it."""
    assert run(*argv)[0] == status
    assert message in capsys.readouterr().err


def test_format_usd_rounds_half_up_exactly() -> None:
    assert format_usd(0) == "0.000000"
    assert format_usd(499) == "0.000000"
    assert format_usd(500) == "0.000001"
    assert format_usd(1_234_567_890) == "1.234568"
    assert format_usd(50 * 10**9) == "50.000000"


def test_parse_time_accepts_durations_and_dates() -> None:
    assert parse_time("7d", NOW, flag="--since") == NOW - 7 * DAY_S
    assert parse_time("2027-01-15", NOW, flag="--since") == T0 - 8 * HOUR_S
    assert parse_time("2027-01-15T16:00+08:00", NOW, flag="--since") == T0
    with pytest.raises(ReportError, match="--until: expected"):
        parse_time("soon", NOW, flag="--until")


def test_text_width_counts_wide_characters_twice() -> None:
    assert text_width("support-bot") == 11
    assert text_width("客服机器人") == 10
    assert text_width("ｆｕｌｌ") == 8
    assert text_width("e\u0301") == 1


@pytest.mark.parametrize(
    ("text", "columns"),
    [
        ("👨\u200d👩\u200d👧", 2),  # one emoji of three joined by ZWJ
        ("👍🏽", 2),  # a skin tone
        ("❤\ufe0f", 2),  # the emoji variation selector: shown as an emoji, wide
        ("علی\u200cرضا", 6),  # a Persian name: its ZWNJ takes none
        ("\U0001fae8", 2),  # an emoji newer than Python 3.11's Unicode 14
        ("🇯🇵", 2),
    ],
)
def test_text_width_of_emoji_sequences_and_joiners(text: str, columns: int) -> None:
    """Each was counted a column a code point (👨‍👩‍👧 as 8): the users' table went askew."""
    assert text_width(text) == columns


def test_the_default_policy_names_its_ledger_without_the_tenant_keys_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The Quick start's `tokenweir report`, run in a shell that never exported the key."""
    monkeypatch.delenv("TOKENWEIR_API_KEY", raising=False)
    monkeypatch.setenv("TOKENWEIR_LEDGER", f"sqlite:///{tmp_path / 'ledger.db'}")
    assert _ledger_location(None, None) == (f"sqlite:///{tmp_path / 'ledger.db'}", "memory")


def test_table_by_tag_counts_a_two_tag_request_under_each_and_once_in_the_total(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'tags.db'}"

    async def write() -> None:
        ledger = open_ledger(url)
        await ledger.start()
        ledger.append(record(1, tags=("search", "beta"), cost_nusd=1_000_000))
        ledger.append(record(2, tags=("search",), cost_nusd=2_000_000))
        ledger.append(record(3, cost_nusd=4_000_000))
        await ledger.aclose()

    asyncio.run(write())
    status, out = run("--ledger", url, "--by", "tag")
    assert status == 0
    _, header, *lines, note = out.splitlines()
    assert header.split()[:3] == ["tenant", "tag", "requests"]
    *rows, total_line = lines
    table = {tuple(line.split()[:2]): line.split()[2:] for line in rows}
    assert table[("alpha", "search")][0] == "2"
    assert table[("alpha", "beta")][0] == "1"
    assert table[("alpha", "(none)")][0] == "1"
    total = total_line.split()  # "total", an empty tag column, then the numbers
    assert total[:2] == ["total", "3"]  # 2 + 1 + 1 rows, 3 requests
    assert "0.007000" in total  # $1 + $2 + $4 thousandths, not $1 more
    assert note.startswith("A request with several tags counts under each")


def test_a_redis_ledgers_password_is_not_printed(redis_server: str) -> None:
    """The report's title line and its JSON `ledger` showed the ledger URL as given, Redis
    password and all, in output that gets pasted into tickets and chats."""
    password = "report-redis-password-5e6f"
    admin = redis.Redis.from_url(redis_server)
    admin.acl_setuser("reporter", enabled=True, passwords=[f"+{password}"], keys=["*"],
                      commands=["+@all"])  # fmt: skip
    try:
        ledger = redis_server.replace("redis://", f"redis://reporter:{password}@")[:-1] + "9"
        outputs = [run("--ledger", ledger, "--format", f) for f in ("table", "json")]
        options = ledger.replace(f"reporter:{password}@", "") + f"?password={password}"
        outputs.append(run("--ledger", options))
    finally:
        admin.acl_deluser("reporter")
        admin.close()
    assert [status for status, _ in outputs] == [0, 0, 0]
    for _, out in outputs:
        assert password not in out
    host = redis_server.removeprefix("redis://").split("/")[0]
    assert outputs[0][1].splitlines()[0].endswith(f"ledger redis://***@{host}/9")
    assert orjson.loads(outputs[1][1])["ledger"] == f"redis://***@{host}/9"
    assert f"ledger redis://{host}/9?password=***" in outputs[2][1]


@pytest.mark.parametrize("format_name", ["table", "csv", "json"])
def test_a_report_of_non_ascii_names_is_written_whatever_the_locale(
    ledger_url: str, format_name: str
) -> None:
    """Under LC_ALL=C (a cron job, a bare container) or into a file on Windows (cp1252) the
    report ended in a UnicodeEncodeError at 客服机器人, the CSV cut short there."""
    window = ["--since", "2027-01-01", "--until", "2027-02-01"]
    done = subprocess.run(
        [sys.executable, "-m", "proxy", "report", "--ledger", ledger_url, *window,
         "--format", format_name],
        env={**os.environ, "PYTHONIOENCODING": "ascii"},
        capture_output=True,
        timeout=60,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()
    if format_name == "table":  # the terminal cannot show it: escaped, the columns still there
        assert "\\u5ba2\\u670d" in done.stdout.decode("ascii")
    else:  # data: UTF-8, as JSON and a spreadsheet's import read it
        assert "客服机器人" in done.stdout.decode("utf-8")
