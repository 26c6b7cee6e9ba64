"""A tenant removed from the policy takes its runtime keys with it: a reload that drops a tenant
revokes them, so a later tenant of the same name never inherits the previous one's keys."""

from __future__ import annotations

import logging

from proxy.keys.runtime import RuntimeKeys
from proxy.policy.model import Policy
from proxy.storage.base import StorageError

__all__ = ["revoke_removed_tenants"]

_log = logging.getLogger("tokenweir.keys")


async def revoke_removed_tenants(keys: RuntimeKeys, before: Policy, after: Policy) -> list[str]:
    """Revoke the runtime keys of the tenants `before` has and `after` has not; their ids.
    Storage trouble is logged, not raised: the reload stands and the keys stay unusable until
    an admin revokes them (or a tenant of that name returns)."""
    removed = sorted(set(before.tenants) - set(after.tenants))
    if not removed:
        return []
    revoked: list[str] = []
    try:
        for record in await keys.listed(None):
            if record.tenant in removed and await keys.revoke(record.id):
                revoked.append(record.id)
    except StorageError as exc:
        _log.error(
            "tenants %s were removed but their runtime keys could not all be revoked (%s): "
            "revoke them with `tokenweir keys list --tenant T` and `tokenweir keys revoke`",
            ", ".join(removed), exc,
        )  # fmt: skip
    if revoked:
        _log.warning(
            "tenants %s were removed from the policy: revoked their runtime keys %s",
            ", ".join(removed), ", ".join(revoked),
        )  # fmt: skip
    return revoked
