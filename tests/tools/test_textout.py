"""The command line's output under a locale that cannot write a tenant's name: `tokenweir
keys` through a real gateway, run as a user runs it (the report's: tests/tools/test_report.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import orjson

from proxy.app import create_app
from proxy.policy import parse_policy
from proxy.tools.textout import text_width
from tests.keys.test_runtime import ADMIN_KEY, policy_text
from tests.servers import serve

TENANT = "客服"


def keys(url: str, *argv: str, encoding: str = "ascii") -> subprocess.CompletedProcess[bytes]:
    """`tokenweir keys` with its stdout in `encoding` (ascii: LC_ALL=C's, or a cp1252 file's)."""
    admin = ["--base-url", url, "--admin-key", ADMIN_KEY]
    return subprocess.run(
        [sys.executable, "-m", "proxy", "keys", *argv, *admin],
        env={**os.environ, "PYTHONIOENCODING": encoding},
        capture_output=True,
        timeout=60,
        check=False,
    )


def test_a_key_for_a_tenant_named_in_chinese_shows_its_secret_whatever_the_locale(
    backend_url: str,
) -> None:
    """The line before the secret named the tenant and raised UnicodeEncodeError: the key was
    created, its secret (shown only once) never."""
    text = policy_text(backend_url, "memory").replace("  alpha:", f"  {TENANT}:")
    with serve(create_app(parse_policy(text, environ={}))) as url:
        created = keys(url, "create", "--tenant", TENANT, "--name", "支持")
        assert created.returncode == 0, created.stderr.decode()
        shown = created.stdout.decode("ascii")
        assert "\\u5ba2\\u670d" in shown  # the tenant, escaped where the terminal cannot show it
        assert shown.splitlines()[-1].startswith("tw-")  # the secret
        table = keys(url, "list", encoding="utf-8").stdout.decode().splitlines()
        header, row = table
        columns = text_width(header[: header.index("exp")]), text_width(row[: row.index("never")])
        assert columns[0] == columns[1]  # 客服 takes four columns of a terminal, not two
        listed = keys(url, "list", "--json")
        assert listed.returncode == 0, listed.stderr.decode()
        (record,) = orjson.loads(listed.stdout)["data"]
        assert (record["tenant"], record["name"]) == (TENANT, "支持")
