"""Runtime keys as every replica sees them: a local mirror of the key storage, refreshed when the
storage's version changes (polled twice a second on shared storage), so a revocation holds
everywhere within 1 s. On `memory` storage only this process changes the keys: no polling.
A stored record this version cannot read is skipped (logged once); it never stops the polling.
A key expired KEEP_EXPIRED_S ago is forgotten: by a create, a listing, or the hourly poll.
Under `serve --workers N`, a worker starting while the storage is down takes the keys its
siblings last read (proxy/keys/kept.py)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import secrets

from proxy.clock import Clock
from proxy.keys.kept import KeptKeys
from proxy.keys.record import KeyAllowance, KeyRecord
from proxy.storage.base import StorageError
from proxy.storage.keys import KeyStore
from proxy.together import cancelled

__all__ = ["KEEP_EXPIRED_S", "REFRESH_S", "RuntimeKeys"]

REFRESH_S = 0.5
KEEP_EXPIRED_S = 30 * 86400.0
"""How long an expired key stays stored and listed (`"expired": true`) before it is deleted."""
_FORGET_EVERY_S = 3600.0  # how often a polling replica looks for keys to forget
_SECRET_PREFIX = "tw-"  # noqa: S105 - how a runtime key starts, not a key
_log = logging.getLogger("tokenweir.keys")


class RuntimeKeys:
    def __init__(
        self,
        store: KeyStore,
        clock: Clock,
        *,
        refresh_s: float = REFRESH_S,
        kept: KeptKeys | None = None,
    ) -> None:
        """`kept`: the records shared by the workers of `serve --workers N`."""
        self._store = store
        self._kept = kept
        self._clock = clock
        self._refresh_s = refresh_s
        self._by_digest: dict[bytes, KeyRecord] = {}
        self._version: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        self._unreadable: dict[str, bytes] = {}  # by id: the records already logged as such
        self._forgot_at: float | None = None  # monotonic; None: not yet
        self._changes = 0  # this process's creates and revokes, applied to the mirror at once

    async def start(self) -> None:
        await self._refresh()
        if self._version is None and self._kept is not None:  # the storage is down
            self._by_digest = {r.digest: r for r in self._readable(self._kept.read())}
        if self._store.shared:  # else every change is this process's own, seen as it is made
            self._task = asyncio.create_task(self._poll())

    async def aclose(self) -> None:
        task, self._task = self._task, None
        try:
            await cancelled([task])
        finally:  # a shutdown step cut short still closes the store's connection
            await self._store.aclose()

    def lookup(self, digest: bytes) -> KeyRecord | None:
        """The live (known, unexpired) key with this SHA-256 digest. Found by the digest, then
        compared in constant time: timing can tell at most about the digest, never the key."""
        record = self._by_digest.get(digest)
        if record is None or not hmac.compare_digest(record.digest, digest):
            return None
        return None if record.expired(self._clock.wall()) else record

    async def create(
        self,
        tenant: str,
        allowance: KeyAllowance,
        *,
        expires_s: float | None = None,
        name: str | None = None,
    ) -> tuple[KeyRecord, str]:
        """A new key for `tenant`: its record and its secret (shown once, stored only hashed)."""
        secret = _SECRET_PREFIX + secrets.token_urlsafe(32)
        now = self._clock.wall()
        record = KeyRecord(
            id="key_" + secrets.token_hex(8),
            tenant=tenant,
            digest=hashlib.sha256(secret.encode()).digest(),
            created=now,
            expires_at=None if expires_s is None else now + expires_s,
            allowance=allowance,
            name=name,
        )
        await self._store.put(record.id, record.dumps())
        self._by_digest[record.digest] = record
        self._changes += 1
        if self._kept is not None:
            self._kept.add(record.id, record.dumps())
        with contextlib.suppress(StorageError):  # the key is made; the old ones wait for later
            await self._forget_expired(self._readable(await self._store.records()))
        return record, secret

    async def revoke(self, key_id: str) -> bool:
        removed = await self._store.delete(key_id)
        self._by_digest = {d: r for d, r in self._by_digest.items() if r.id != key_id}
        self._changes += 1
        if self._kept is not None:
            self._kept.revoke(key_id)
        return removed

    async def listed(self, tenant: str | None) -> list[KeyRecord]:
        """The stored keys (of one tenant, or all), read from storage, oldest first."""
        records = self._readable(await self._store.records())
        forgotten = await self._forget_expired(records)
        return sorted(
            (
                r
                for r in records
                if r.id not in forgotten and (tenant is None or r.tenant == tenant)
            ),
            key=lambda r: r.created,
        )

    async def _forget_expired(self, records: list[KeyRecord]) -> set[str]:
        """Delete the keys expired KEEP_EXPIRED_S ago or more; their ids. A storage error on
        the way stops here: the rest wait for the next time (ids are never reused)."""
        now = self._clock.wall()
        forgotten: set[str] = set()
        for record in records:
            if record.expires_at is not None and now >= record.expires_at + KEEP_EXPIRED_S:
                try:
                    await self.revoke(record.id)  # False: another replica deleted it first
                except StorageError:
                    break
                forgotten.add(record.id)
        if forgotten:
            _log.info("deleted runtime keys expired 30 days ago: %s", ", ".join(sorted(forgotten)))
        return forgotten

    async def _refresh(self) -> None:
        changes = self._changes
        try:
            version = await self._store.version()
            if version == self._version:
                return
            stored = await self._store.records()
        except StorageError as exc:
            if not self._failing:
                _log.warning("runtime keys not refreshed (the last known stay in use): %s", exc)
            self._failing = True
            return
        self._failing = False
        if self._changes != changes:
            # A create or revoke here while the storage was read: what was read may be older
            # than it (a new key answered 401 for up to half a second). The next poll reads again.
            return
        self._by_digest = {r.digest: r for r in self._readable(stored)}
        if self._kept is not None:  # the storage lost its data if its version went back
            restarted = self._version is not None and version < self._version
            self._kept.keep(version, stored, restarted=restarted)
        self._version = version

    def _readable(self, stored: dict[str, bytes]) -> list[KeyRecord]:
        """The records that parse. One that does not (written by a newer tokenweir during a
        rolling upgrade, or edited by hand) is skipped, and logged once, not on every poll."""
        records, unreadable = [], {}
        for key_id, data in stored.items():
            try:
                records.append(KeyRecord.loads(key_id, data))
            except Exception as exc:  # this record's fault: skip it alone
                unreadable[key_id] = data
                if self._unreadable.get(key_id) != data:
                    _log.error(
                        "runtime key %s cannot be read and is ignored on this replica (it does "
                        "not authenticate here; revoke or rewrite it): %s: %s",
                        key_id, type(exc).__name__, _first_lines(exc),
                    )  # fmt: skip
        self._unreadable = unreadable
        return records

    async def _forget_now_and_then(self) -> None:
        """On the first poll and hourly after it: a replica nobody asks to create or list keys
        still forgets the long expired ones."""
        now = self._clock.monotonic()
        if self._forgot_at is not None and now - self._forgot_at < _FORGET_EVERY_S:
            return
        self._forgot_at = now
        with contextlib.suppress(StorageError):  # the keys' poll itself logs storage trouble
            await self._forget_expired(self._readable(await self._store.records()))

    async def _poll(self) -> None:
        failed = False
        while True:
            await asyncio.sleep(self._refresh_s)
            try:
                await self._refresh()
                await self._forget_now_and_then()
            except Exception:  # the poll's outermost handler: revocations must keep arriving
                if not failed:
                    _log.exception("runtime keys not refreshed (the last known stay in use)")
                failed = True
            else:
                failed = False


def _first_lines(exc: Exception) -> str:
    """What is wrong, on one line (pydantic's errors end with a link on a line of its own)."""
    return "; ".join(line.strip() for line in str(exc).splitlines()[:3])
