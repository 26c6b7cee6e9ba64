"""Keep each tenant to the state the shared backend keeps for it: a Responses request continues
only a response its own tenant made, a Messages request runs only in a code-execution container
its own tenant's answer ran in, neither names a stored object no tenant can own, and a
prompt-cache salt or key a client sends becomes its tenant's own; a client naming KV-cache blocks
to read (vLLM's `kv_transfer_params`) is refused. Writes the body's `cache_salt` and
`prompt_cache_key`; remembers, as an answer ends, which tenant its stored object is for."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from proxy.apis.messages import container_id
from proxy.apis.responses import names_stored_item
from proxy.clock import Clock
from proxy.context import Admitted
from proxy.errors import BadRequest, NotFound, StorageUnavailable
from proxy.storage.base import StorageError
from proxy.storage.owned import OwnedIds

__all__ = ["KEPT_S", "MAX_ID_CHARS", "StoredState", "answer_id", "stored_id"]

_log = logging.getLogger("tokenweir.stored")

KEPT_S = 30 * 86_400  # as long as OpenAI keeps a stored response; vLLM keeps its until restart
MAX_ID_CHARS = 256  # vLLM's are `resp_` and 32 hex digits, OpenAI's about 50 characters
# vLLM's prefix-cache salt, and OpenAI's key grouping requests that share a prefix cache
_CACHE_NAMES = ("cache_salt", "prompt_cache_key")
_SALT_BYTES = 16  # a salt of 32 hex digits: within any engine's bounds on its characters
_CONTAINER = "container:"  # a container's id as remembered, apart from response ids


class StoredState:
    """`previous_response_id` of another tenant's response (or one the gateway never relayed)
    is a 404, as the backend answers an id it does not have, so nobody learns whether an id
    exists, and so is another tenant's `container`; `conversation` and item references are
    400s. A request without these fields pays a few dict lookups and no storage call."""

    def __init__(self, owned: OwnedIds, clock: Clock) -> None:
        self._owned = owned
        self._clock = clock

    async def __call__(self, ctx: Admitted) -> None:
        body, tenant = ctx.body, ctx.tenant_name
        if body.get("kv_transfer_params") is not None:
            raise _refused(
                "kv_transfer_params",
                "it names KV-cache blocks a disaggregated vLLM engine would read, which may be "
                "another tenant's (the router in front of the engines sets it)",
            )
        for field in _CACHE_NAMES:
            given = body.get(field)
            if given is not None:
                body[field] = _tenants_own(tenant, given, field)
        if ctx.operation == "messages":
            container = body.get("container")
            # An id, or settings naming one (without one: a new container's settings)
            given = container.get("id") if isinstance(container, dict) else container
            if given is not None:
                # Anthropic runs the request in it, with the files earlier requests left there.
                await self._require_own(tenant, given, "container", "container")
        elif ctx.operation == "responses":
            await self._check_responses(tenant, body)

    async def _check_responses(self, tenant: str, body: dict[str, Any]) -> None:
        if body.get("request_id") is not None:
            # vLLM stores the response under the id the request chose: one tenant choosing
            # another's would replace that tenant's stored conversation with its own.
            raise _refused(
                "request_id",
                "the backend would store the response under it, over any response of that "
                "id (send x-request-id to name a request)",
            )
        _refuse_unownable(body)
        previous = body.get("previous_response_id")
        if previous is not None:
            await self._require_own(tenant, previous, "previous_response_id", "previous response")

    async def _require_own(self, tenant: str, given: object, param: str, what: str) -> None:
        """A 404, as the backend answers an id it does not have, unless `given` names an object
        stored for `tenant`'s answers (a container's id is remembered apart)."""
        name = _CONTAINER + given if param == "container" and type(given) is str else given
        if type(name) is not str or not await self._owns(tenant, name):
            raise NotFound(
                f"{what.capitalize()} not found: '{param}' names no {what} made for this key's "
                "tenant through this gateway (or it has expired).",
                param=param,
                code=f"{what.replace(' ', '_')}_not_found",
            )

    async def _owns(self, tenant: str, response_id: str) -> bool:
        try:
            return await self._owned.owns(tenant, response_id, self._clock.wall())
        except StorageError as exc:
            # Closed: whose response it is cannot be known, and guessing may show another's.
            raise StorageUnavailable(
                "The gateway cannot check whose stored response this is; retry shortly.",
                retry_after_s=1,
            ) from exc

    def holding(self, ctx: Admitted) -> bool:
        return ctx.outcome.stored_id is not None

    async def settle(self, ctx: Admitted) -> None:
        """Called before the answer's end goes out, so the client's next turn finds its id."""
        stored = ctx.outcome.stored_id
        if stored is None:
            return
        try:
            await self._owned.claim(ctx.tenant_name, stored, self._clock.wall() + KEPT_S)
        except StorageError as exc:
            # The tenant's next turn is refused as unknown: never another tenant's.
            # The id is left out: at the backend itself it opens what it names.
            _log.warning("could not remember whose stored response or container is: %s", exc)


def answer_id(operation: str, answer: dict[str, Any]) -> object:
    """What a whole answer names that the backend keeps: a response's id, a message's container."""
    if operation == "messages":
        return container_id(answer)
    return None if answer.get("store") is False else answer.get("id")  # not stored: no owner


def stored_id(ctx: Admitted, given: object) -> str | None:
    """The name the gateway remembers an answer's stored object by: a Responses answer's id
    (none for a request sent with `store: false`), a Messages answer's container as
    `container:<id>`; none for an id that is not a string of a sane size."""
    if type(given) is not str or not 0 < len(given) <= MAX_ID_CHARS:
        return None
    if ctx.operation == "messages":
        return _CONTAINER + given
    return None if ctx.body.get("store") is False else given


def _tenants_own(tenant: str, given: Any, field: str) -> str:
    """The client's name for a part of the backend's prefix cache made its tenant's: the same
    name sent by two tenants is two names, so no tenant can share (and time) the cache another
    tenant's name keeps apart, and one tenant's requests still share theirs."""
    if type(given) is not str or not given:
        raise BadRequest(f"'{field}' must be a non-empty string.", param=field)
    mixed = hashlib.sha256(f"{tenant}\0{given}".encode(errors="surrogatepass"))
    return mixed.hexdigest()[: 2 * _SALT_BYTES]


def _refuse_unownable(body: dict[str, Any]) -> None:
    """A stored conversation, or an input item naming a stored item by its id: objects the
    gateway never sees made (it serves no conversations route, and an item's id is not its
    response's), so it cannot tell whose they are, and the backend would read them to anyone."""
    if body.get("conversation") is not None:
        raise _unownable("conversation", "a stored conversation")
    given = body.get("input")
    if type(given) is list:
        for index, item in enumerate(given):
            if names_stored_item(item):
                raise _unownable(f"input[{index}]", "a stored item by its id")


def _unownable(param: str, what: str) -> BadRequest:
    return _refused(
        param,
        f"it names {what}, which this gateway cannot tell is your tenant's, on a backend every "
        "tenant shares (send the turns in 'input', or continue a response of your own with "
        "'previous_response_id')",
    )


def _refused(param: str, why: str) -> BadRequest:
    return BadRequest(
        f"'{param}' is not accepted by this gateway: {why}.",
        param=param,
        code="unsupported_parameter",
    )
