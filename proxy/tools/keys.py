"""`tokenweir keys create|list|revoke`: runtime keys through a running gateway's admin API."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any
from urllib.parse import quote

import httpx
import orjson

from proxy.keys.record import MAX_ALLOWANCE
from proxy.tools.textout import stdout_for, text_width

__all__ = ["ADMIN_KEY_ENV", "add_arguments"]

ADMIN_KEY_ENV = "TOKENWEIR_ADMIN_KEY"
_TIMEOUT_S = 10.0
_MAX_DIGITS = len(str(MAX_ALLOWANCE))  # more is refused here: the gateway's 400 names the bound


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(title="keys commands", metavar="COMMAND")
    create = commands.add_parser("create", help="create a key (its secret is shown once)")
    _common(create)
    create.add_argument("--tenant", required=True)
    create.add_argument("--name", help="a label to recognise the key by")
    create.add_argument("--expires", help="lifetime, e.g. 30d or 12h (default: none)")
    create.add_argument(
        "--budget", help="the key's own quotas: tokens_per_day=N,tokens_per_month=N"
    )
    create.add_argument(
        "--limits", help="the key's own limits: requests_per_minute=N,tokens_per_minute=N"
    )
    create.set_defaults(run=_create)
    listing = commands.add_parser("list", help="list runtime keys (never their secrets)")
    _common(listing)
    listing.add_argument("--tenant", help="only this tenant's keys")
    listing.set_defaults(run=_list)
    revoke = commands.add_parser("revoke", help="revoke a key on every replica within a second")
    _common(revoke)
    revoke.add_argument("key_id", help="the key's id (key_...)")
    revoke.add_argument("--tenant", help="refuse unless the key is this tenant's")
    revoke.set_defaults(run=_revoke)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8080", help="the gateway")
    parser.add_argument("--admin-key", help=f"an admin key (default: ${ADMIN_KEY_ENV})")
    parser.add_argument("--json", action="store_true", help="print the API's JSON answer")


def _create(args: argparse.Namespace) -> int:
    stdout_for(data=args.json)
    body: dict[str, object] = {"tenant": args.tenant}
    try:
        if args.budget:
            body["budget"] = _pairs(args.budget, "--budget")
        if args.limits:
            body["limits"] = _pairs(args.limits, "--limits")
    except ValueError as exc:
        print(f"tokenweir: {exc}", file=sys.stderr)
        return 2
    if args.expires:
        body["expires"] = args.expires
    if args.name:
        body["name"] = args.name
    answer = _call(args, "POST", "/admin/keys", body)
    if answer is None:
        return 1
    if args.json:
        print(orjson.dumps(answer).decode())
    else:
        print(f"created {answer['id']} for tenant {answer['tenant']}; the key (shown only once):")
        print(answer["key"])
    return 0


def _list(args: argparse.Namespace) -> int:
    stdout_for(data=args.json)
    params = {"tenant": args.tenant} if args.tenant else None
    answer = _call(args, "GET", "/admin/keys", params=params)
    if answer is None:
        return 1
    if args.json:
        print(orjson.dumps(answer).decode())
        return 0
    print(f"{'id':<22} {'tenant':<20} {'expires_at':<12} budget / limits")
    for key in answer["data"]:
        own = {**key["budget"], **key["limits"]}
        extra = ",".join(f"{k}={v}" for k, v in own.items() if v is not None) or "-"
        expires = "expired" if key["expired"] else str(key["expires_at"] or "never")
        tenant = key["tenant"] + " " * (20 - text_width(key["tenant"]))  # 客服 takes 4 columns
        print(f"{key['id']:<22} {tenant} {expires:<12} {extra}")
    return 0


def _revoke(args: argparse.Namespace) -> int:
    stdout_for(data=args.json)
    if args.tenant:
        listed = _call(args, "GET", "/admin/keys", params={"tenant": args.tenant})
        if listed is None:
            return 1
        if all(key["id"] != args.key_id for key in listed["data"]):
            print(f"tokenweir: {args.key_id} is not a key of {args.tenant}", file=sys.stderr)
            return 1
    if {".", ".."} & set(args.key_id.split("/")):  # resolved away by the URL: another route
        print(f"tokenweir: {args.key_id!r} is not a key id (key_..., as listed)", file=sys.stderr)
        return 2
    # Quoted: `?` or `#` in it would otherwise end the path, and revoke the id before them.
    answer = _call(args, "DELETE", "/admin/keys/" + quote(args.key_id, safe="/"))
    if answer is None:
        return 1
    print(orjson.dumps(answer).decode() if args.json else f"revoked {args.key_id}")
    return 0


def _pairs(text: str, flag: str) -> dict[str, int]:
    pairs: dict[str, int] = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        number = value.strip()
        # ASCII digits: int() takes no superscripts, and the request's JSON no number past 64 bits.
        if not name.strip() or not (number.isascii() and number.isdigit()):
            raise ValueError(f"{flag} takes name=N pairs separated by commas, not {item!r}")
        if len(number) > _MAX_DIGITS:
            raise ValueError(f"{flag}: {name.strip()} must be at most {MAX_ALLOWANCE:,}")
        pairs[name.strip()] = int(number)
    return pairs


def _call(
    args: argparse.Namespace,
    method: str,
    path: str,
    body: object = None,
    params: dict[str, str] | None = None,
) -> dict[str, Any] | None:
    """The admin API's JSON answer, or None after printing why there is none."""
    admin_key = args.admin_key or os.environ.get(ADMIN_KEY_ENV)
    if not admin_key:
        print(f"tokenweir: give an admin key: --admin-key or ${ADMIN_KEY_ENV}", file=sys.stderr)
        return None
    if not (admin_key.isascii() and admin_key.isprintable()):
        # A header cannot carry it: a UnicodeEncodeError traceback, or "cannot reach" the gateway.
        print(
            f"tokenweir: the admin key (--admin-key or ${ADMIN_KEY_ENV}) must be printable "
            "ASCII: no line breaks, control or non-ASCII characters",
            file=sys.stderr,
        )
        return None
    try:
        if (httpx.URL(args.base_url).port or 0) > 65535:  # else connected to port % 65536
            raise httpx.InvalidURL("the port is past 65535")
        response = httpx.request(
            method,
            args.base_url.rstrip("/") + path,
            headers={"authorization": f"Bearer {admin_key}"},
            content=orjson.dumps(body) if body is not None else None,
            params=params,
            timeout=_TIMEOUT_S,
        )
    except httpx.InvalidURL as exc:
        print(f"tokenweir: --base-url {args.base_url!r} is not a URL: {exc}", file=sys.stderr)
        return None
    except httpx.HTTPError as exc:
        print(f"tokenweir: cannot reach {args.base_url}: {exc}", file=sys.stderr)
        return None
    if response.is_redirect:  # not followed: a redirected DELETE or POST may be resent as a GET
        where = response.headers.get("location", "?")
        print(
            f"tokenweir: {response.status_code}: the gateway answered with a redirect to "
            f"{where}; nothing was done (give --base-url as the URL the gateway serves, and "
            "a key id as listed)",
            file=sys.stderr,
        )
        return None
    try:
        answer = response.json()
    except ValueError:
        answer = {}
    if not response.is_success or not isinstance(answer, dict):
        error = answer.get("error", {}) if isinstance(answer, dict) else {}
        message = error.get("message") if isinstance(error, dict) else None
        print(f"tokenweir: {response.status_code}: {message or response.text}", file=sys.stderr)
        return None
    return answer
