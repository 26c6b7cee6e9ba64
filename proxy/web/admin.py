"""Admin routes (admin keys only): `POST /admin/reload` and the runtime keys behind
`tokenweir keys` (`POST /admin/keys`, `GET /admin/keys?tenant=T`, `DELETE /admin/keys/{id}`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import orjson
import pydantic
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from proxy.asgi.body import ClientGone, read_body
from proxy.asgi.respond import send_error, send_json
from proxy.errors import BadRequest, GatewayError, NotFound, PermissionDenied, StorageUnavailable
from proxy.keys.record import KeyRequest, beyond_tenant
from proxy.stages.auth import authorization_of
from proxy.storage.base import StorageError

if TYPE_CHECKING:
    from proxy.gateway import Gateway
    from proxy.reload import Reloader

__all__ = ["SIBLINGS_WAIT_S", "admin_routes"]

SIBLINGS_WAIT_S = 10.0
"""How long `POST /admin/reload` waits for one more of the other workers of
`serve --workers N` to serve the version it reloaded (they reload one at a time)."""
_SIBLINGS_POLL_S = 0.05
_log = logging.getLogger("tokenweir.reload")

_MAX_BODY_BYTES = 16 * 1024
_BODY_TIMEOUT_S = 10.0
_NO_STORE = ((b"cache-control", b"no-store"),)

_Handler = Callable[["Gateway", Scope, Receive], Awaitable[tuple[int, object]]]


def admin_routes() -> list[Route]:
    return [
        Route("/admin/reload", _Admin(_reload), methods=["POST"]),
        Route("/admin/keys", _Admin(_create_key), methods=["POST"]),
        Route("/admin/keys", _Admin(_list_keys), methods=["GET"]),
        Route("/admin/keys/{key_id}", _Admin(_revoke_key), methods=["DELETE"]),
        # Else Starlette answers a bare 307 to the path without it (`DELETE /admin/keys/`).
        Route("/admin/{path:path}/", _TrailingSlash()),
    ]


class _Admin:
    """One admin endpoint: the admin key checked, errors OpenAI-shaped, storage trouble a 503."""

    def __init__(self, handler: _Handler) -> None:
        self._handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gateway: Gateway = scope["state"]["gateway"]
        try:
            _check_admin(gateway, authorization_of(Headers(scope=scope)))
            status, body = await self._handler(gateway, scope, receive)
        except StorageError as exc:
            error = StorageUnavailable(f"The key storage cannot be reached: {exc}", retry_after_s=1)
            await send_error(send, error, _NO_STORE)
            return
        except GatewayError as exc:
            await send_error(send, exc, _NO_STORE)
            return
        except ClientGone:
            return
        await send_json(send, status, orjson.dumps(body), _NO_STORE)


class _TrailingSlash:
    """An admin path ending in `/` (an empty key id, a URL joined by hand): a 404 saying so."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        method, path = scope["method"], scope["path"]
        if method == "DELETE" and path == "/admin/keys/":
            error = NotFound(
                "DELETE /admin/keys/ names no key: revoke one with DELETE /admin/keys/{id}, "
                "an id as GET /admin/keys lists it.",
                param="id",
            )
        else:
            error = NotFound(
                f"Unknown request URL: {method} {path}. "
                f"Admin routes end without a slash: {path.rstrip('/')}."
            )
        await send_error(send, error, _NO_STORE)


def _check_admin(gateway: Gateway, authorization: str | None) -> None:
    if gateway.keyring.is_admin(authorization):
        return
    gateway.keyring.tenant_for(authorization)  # a bad or missing key: 401
    raise PermissionDenied("This route needs an admin key.", code="admin_only")


async def _reload(gateway: Gateway, scope: Scope, receive: Receive) -> tuple[int, object]:
    reloader: Reloader[Gateway] = scope["state"]["reloader"]
    result = await reloader.reload("admin API")
    # Unchanged here is no news for the other workers: one may serve another version (a SIGHUP
    # sent to one worker, or a reload one refused while the file was being written).
    reloader.tell_siblings()
    await _served_everywhere(gateway, result.policy_hash)
    return 200, {
        "status": "reloaded" if result.changed else "unchanged",
        "policy_hash": result.policy_hash,
        "previous_hash": result.previous_hash,
    }


async def _served_everywhere(gateway: Gateway, policy_hash: str) -> None:
    """Under `serve --workers N`: wait until every live worker serves `policy_hash` (the
    supervisor has them reload one at a time, each once the one before shows it done), so that
    what the answer says holds whichever worker takes the next request. It gives up once no
    further worker took the version for SIBLINGS_WAIT_S (a worker that refused the file serves
    on what it had: logged, and shown by tokenweir_policy_info)."""
    metrics = gateway.services.metrics
    behind, polls = -1, 0  # workers not serving it, and polls since that number last fell
    while True:
        served = metrics.workers_by_version()
        # (None serving it any more: a later reload applied a newer file everywhere.)
        if served is None or policy_hash not in served or len(served) == 1:
            return
        others = sum(count for version, count in served.items() if version != policy_hash)
        if behind < 0 or others < behind:
            behind, polls = others, 0
        elif polls * _SIBLINGS_POLL_S >= SIBLINGS_WAIT_S:
            break
        polls += 1
        await asyncio.sleep(_SIBLINGS_POLL_S)
    _log.warning(
        "policy %s: not every worker serves it %.0f s after the last one took it up (they "
        "serve %s)", policy_hash, SIBLINGS_WAIT_S, ", ".join(sorted(served)),
    )  # fmt: skip


async def _create_key(gateway: Gateway, scope: Scope, receive: Receive) -> tuple[int, object]:
    raw = await read_body(receive, Headers(scope=scope), _MAX_BODY_BYTES, _BODY_TIMEOUT_S)
    try:
        wanted = KeyRequest.model_validate_json(raw or b"{}")
    except pydantic.ValidationError as exc:
        fields = [".".join(str(p) for p in e["loc"]) for e in exc.errors()]
        problems = "; ".join(
            f"{field or 'body'}: {e['msg']}" for field, e in zip(fields, exc.errors(), strict=True)
        )
        raise BadRequest(f"Invalid key request: {problems}", param=fields[0] or None) from None
    tenant = gateway.policy.tenants.get(wanted.tenant)
    if tenant is None:
        raise BadRequest(f"No tenant {wanted.tenant!r} in the policy.", param="tenant")
    allowance = wanted.allowance()
    above = beyond_tenant(allowance, tenant)
    if above:
        raise BadRequest("A key's limits live within its tenant's: " + "; ".join(above) + ".")
    keys = gateway.services.keys
    record, secret = await keys.create(
        wanted.tenant, allowance, expires_s=wanted.expires, name=wanted.name
    )
    serving: Gateway = scope["state"]["live"].current
    if wanted.tenant not in serving.policy.tenants:
        # A reload removed the tenant meanwhile, and its revocation may have listed the tenant's
        # keys before this one was stored. (A reload after this check lists it: it is stored.)
        await keys.revoke(record.id)
        removed = f"No tenant {wanted.tenant!r} in the policy (a reload removed it)."
        raise BadRequest(removed, param="tenant")
    return 201, {**record.public(), "key": secret}


async def _list_keys(gateway: Gateway, scope: Scope, receive: Receive) -> tuple[int, object]:
    tenant = Request(scope).query_params.get("tenant") or None
    records = await gateway.services.keys.listed(tenant)
    now = gateway.clock.wall()
    data = [{**r.public(), "expired": r.expired(now)} for r in records]
    return 200, {"object": "list", "data": data}


async def _revoke_key(gateway: Gateway, scope: Scope, receive: Receive) -> tuple[int, object]:
    key_id = str(scope["path_params"]["key_id"])
    if not await gateway.services.keys.revoke(key_id):
        raise NotFound(f"No runtime key {key_id!r}.", param="id")
    return 200, {"id": key_id, "object": "api_key", "deleted": True}
