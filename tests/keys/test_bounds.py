"""Runtime keys asked for out of range: a 400 naming the field, and nothing stored; a record
stored before the bounds (a far expiry) still lists on every replica."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import orjson
import pytest
import redis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import RedirectResponse
from starlette.routing import Route

from proxy.app import create_app
from proxy.cli import main
from proxy.policy import parse_policy
from tests.keys.test_runtime import ADMIN_KEY, policy_text
from tests.servers import serve

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
RECORDS = "tw:{keys}:records"


@pytest.fixture
def gateway(backend_url: str, redis_url: str) -> Iterator[httpx.Client]:
    """A gateway on Redis whose tenant has no limits of its own (nothing caps a key's)."""
    policy = parse_policy(policy_text(backend_url, redis_url, limits="{}"), environ={})
    with serve(create_app(policy)) as url, httpx.Client(base_url=url, headers=ADMIN) as http:
        yield http


@pytest.mark.parametrize(
    ("asked", "field", "says"),
    [
        ({"expires": "300000000000000d"}, "expires", "100 years"),
        ({"expires": 1e308}, "expires", "100 years"),
        ({"limits": {"requests_per_minute": 10**30}}, "limits.requests_per_minute", "1000000"),
        ({"budget": {"tokens_per_month": 10**16}}, "budget.tokens_per_month", "1000000"),
        ({"budget": {"tokens_per_day": True}}, "budget.tokens_per_day", "not true"),
        ({"limits": {"requests_per_minute": "5"}}, "limits.requests_per_minute", "integer"),
        ({"budget": {"tokens_per_day": 2.0}}, "budget.tokens_per_day", "integer"),
    ],
)
def test_a_key_out_of_range_is_a_400_naming_the_field_and_is_not_stored(
    gateway: httpx.Client, redis_url: str, asked: dict[str, object], field: str, says: str
) -> None:
    answer = gateway.post("/admin/keys", json={"tenant": "alpha", **asked})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == field
    assert field in error["message"]
    assert says in error["message"]
    with redis.Redis.from_url(redis_url) as raw:
        assert raw.hlen(RECORDS) == 0  # no secret nobody has
    listed = gateway.get("/admin/keys")
    assert listed.status_code == 200
    assert listed.json()["data"] == []


def test_the_cli_is_told_which_field_is_out_of_range_and_the_bounds_themselves_pass(
    gateway: httpx.Client, capsys: pytest.CaptureFixture[str]
) -> None:
    admin = ["--base-url", str(gateway.base_url), "--admin-key", ADMIN_KEY, "--json"]
    code = main(["keys", "create", "--tenant", "alpha", "--expires", "300000000000000d", *admin])
    err = capsys.readouterr().err
    assert code != 0
    assert "400" in err
    assert "expires" in err
    assert "100 years" in err
    assert gateway.get("/admin/keys").json()["data"] == []
    longest = ["--expires", "36500d", "--budget", f"tokens_per_day={10**15}"]
    code = main(["keys", "create", "--tenant", "alpha", *longest, *admin])
    assert code == 0
    created = orjson.loads(capsys.readouterr().out)
    assert created["expires_at"] == created["created"] + 36500 * 86400
    assert created["budget"]["tokens_per_day"] == 10**15


def test_a_stored_record_beyond_the_bounds_still_lists(
    gateway: httpx.Client, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A key made before the bounds, with an expiry past what an integer of 64 bits holds:
    the listing shows it (its expiry as the latest date shown) and its neighbours."""
    made = gateway.post("/admin/keys", json={"tenant": "alpha", "name": "today"}).json()
    old = {
        "tenant": "alpha", "digest": "sha256:" + "ab" * 32, "created": 1_700_000_000.0,
        "expires_at": 2.6e19, "allowance": {"tokens_per_day": 10**17}, "name": "far",
    }  # fmt: skip
    with redis.Redis.from_url(redis_url) as raw:
        raw.hset(RECORDS, "key_farfuture", orjson.dumps(old))
    listed = gateway.get("/admin/keys")
    assert listed.status_code == 200, listed.text
    by_id = {k["id"]: k for k in listed.json()["data"]}
    assert set(by_id) == {"key_farfuture", made["id"]}
    assert by_id["key_farfuture"]["expires_at"] == 253402300799  # 9999-12-31T23:59:59Z
    assert by_id["key_farfuture"]["expired"] is False
    assert by_id["key_farfuture"]["budget"]["tokens_per_day"] == 10**17
    code = main(["keys", "list", "--base-url", str(gateway.base_url), "--admin-key", ADMIN_KEY])
    assert code == 0
    assert "key_farfuture" in capsys.readouterr().out
    revoked = gateway.delete("/admin/keys/key_farfuture")  # so the admin can get rid of it
    assert revoked.status_code == 200


def test_the_cli_takes_no_redirect_for_done(
    gateway: httpx.Client, capsys: pytest.CaptureFixture[str]
) -> None:
    """A redirect (an http:// URL a proxy sends to https://) did nothing: the CLI said
    `revoked` with exit code 0 while the key kept working, and `create` crashed. A trailing
    slash on a key id, once such a redirect, is the gateway's 404."""
    admin = ["--base-url", str(gateway.base_url), "--admin-key", ADMIN_KEY]
    assert main(["keys", "create", "--tenant", "alpha", "--json", *admin]) == 0
    key_id = orjson.loads(capsys.readouterr().out)["id"]
    assert main(["keys", "revoke", key_id + "/", *admin]) == 1
    out, err = capsys.readouterr()
    assert "revoked" not in out
    assert "404" in err
    assert "without a slash" in err
    assert [k["id"] for k in gateway.get("/admin/keys").json()["data"]] == [key_id]

    def moved(request: Request) -> RedirectResponse:
        return RedirectResponse("https://gateway.example/admin/keys", status_code=301)

    methods = ["GET", "POST", "DELETE"]
    with serve(Starlette(routes=[Route("/{path:path}", moved, methods=methods)])) as url:
        elsewhere = ["--base-url", url, "--admin-key", ADMIN_KEY]
        assert main(["keys", "create", "--tenant", "alpha", *elsewhere]) == 1
        assert "https://gateway.example/admin/keys" in capsys.readouterr().err
        assert main(["keys", "list", *elsewhere]) == 1


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--budget", f"tokens_per_day={10**23}"], "tokens_per_day must be at most"),
        (["--limits", "requests_per_minute=²"], "name=N pairs"),
    ],
)
def test_a_number_past_what_a_request_can_carry_is_refused_in_one_line(
    gateway: httpx.Client, flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 23-digit quota was a TypeError traceback (JSON takes no integer past 64 bits), and a
    superscript digit passed as a number, then failed to be one."""
    admin = ["--base-url", str(gateway.base_url), "--admin-key", ADMIN_KEY]
    assert main(["keys", "create", "--tenant", "alpha", *flags, *admin]) == 2
    assert says in capsys.readouterr().err
    assert gateway.get("/admin/keys").json()["data"] == []


@pytest.mark.parametrize("url", ["http://[::1", "http://127.0.0.1:99999"])
def test_a_base_url_that_is_no_url_is_said_so(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    # httpx's InvalidURL is no HTTPError: it was a traceback; port 99999 was asked on 34463.
    assert main(["keys", "list", "--base-url", url, "--admin-key", ADMIN_KEY]) == 1
    assert f"--base-url {url!r} is not a URL" in capsys.readouterr().err


def test_revoke_takes_the_id_whole_and_no_other_route(
    gateway: httpx.Client, capsys: pytest.CaptureFixture[str]
) -> None:
    """`revoke 'key_1?x'` revoked key_1 (the `?` began a query string), and `revoke ../reload`
    asked for DELETE /admin/reload."""
    admin = ["--base-url", str(gateway.base_url), "--admin-key", ADMIN_KEY]
    assert main(["keys", "create", "--tenant", "alpha", "--json", *admin]) == 0
    key_id = orjson.loads(capsys.readouterr().out)["id"]
    for typed in (f"{key_id}?x", f"{key_id}#x"):
        assert main(["keys", "revoke", typed, *admin]) == 1
        assert f"No runtime key '{typed}'" in capsys.readouterr().err
    assert main(["keys", "revoke", "../reload", *admin]) == 2
    assert "is not a key id" in capsys.readouterr().err
    assert [k["id"] for k in gateway.get("/admin/keys").json()["data"]] == [key_id]


@pytest.mark.parametrize("admin_key", ["\u043a\u043b\u044e\u0447", "line\nbreak"])
def test_an_admin_key_no_header_can_carry_is_said_so(
    admin_key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A UnicodeEncodeError traceback, and "cannot reach" a gateway that was never asked."""
    assert main(["keys", "list", "--base-url", "http://127.0.0.1:9", "--admin-key", admin_key]) == 1
    assert "the admin key (--admin-key or $TOKENWEIR_ADMIN_KEY) must be printable ASCII" in (
        capsys.readouterr().err
    )
