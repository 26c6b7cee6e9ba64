"""A runtime key as stored (its SHA-256 digest, never the secret) and as an admin asks for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import orjson
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from proxy.policy.model import Tenant
from proxy.policy.numbers import NoBoolAsNumber
from proxy.policy.units import parse_duration_s
from proxy.storage.scopes import tenant_scope

__all__ = [
    "MAX_ALLOWANCE",
    "MAX_EXPIRES_S",
    "KeyAllowance",
    "KeyRecord",
    "KeyRequest",
    "beyond_tenant",
    "policy_key_id",
]

MAX_EXPIRES_S = 100 * 365 * 86400
"""The longest lifetime a new key may be given: 100 years (36500d)."""
MAX_ALLOWANCE = 10**15
"""The largest quota or limit a new key may be given: far above any real one, and with room
to sum within Redis's and the ledger's int64 (see proxy/ledger/base.py's MAX_RECORD_INT)."""
_LATEST_SHOWN_S = 253402300799
"""9999-12-31T23:59:59Z: a stored expiry beyond it (only a key made before MAX_EXPIRES_S can
have one) is shown as this, so that one old record cannot break the listing."""

POLICY_KEY_ID_HEX = 12
PositiveInt = Annotated[int, Field(gt=0)]
# What an admin may ask for: a JSON integer, strictly (not "5", not 2.0, not true).
Allowance = Annotated[int, Field(gt=0, le=MAX_ALLOWANCE, strict=True)]


def _lifetime(seconds: float) -> float:
    if seconds > MAX_EXPIRES_S:
        raise ValueError(f"a key lives at most 100 years (36500d, {MAX_EXPIRES_S} seconds)")
    return seconds


def _printable(name: str) -> str:
    """A key's name is shown by `tokenweir keys list` and written to the ledger and log lines: a
    C0 control (a newline, an ESC), DEL or a C1 control (NEL breaks a line, CSI starts a
    terminal escape) would forge or garble them."""
    if any(ord(char) < 0x20 or 0x7F <= ord(char) <= 0x9F for char in name):
        raise ValueError("a key's name may not hold a newline or another control character")
    return name


def policy_key_id(digest: bytes) -> str:
    """A policy file's key as the ledger names it: `sha256:` and the first 12 hex digits of
    its digest, the start of its entry in the file. 48 bits of a hash of a secret: they name
    the key without telling anything about it (runtime keys have their own `key_...` id)."""
    return "sha256:" + digest.hex()[:POLICY_KEY_ID_HEX]


class KeyAllowance(BaseModel):
    """A key's own budget and limits, on top of (and within) its tenant's. Not bounded here: a
    record stored before MAX_ALLOWANCE still loads (KeyRequest bounds what is asked for)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tokens_per_day: PositiveInt | None = None
    tokens_per_month: PositiveInt | None = None
    requests_per_minute: PositiveInt | None = None
    tokens_per_minute: PositiveInt | None = None

    @property
    def empty(self) -> bool:
        return all(v is None for v in self.model_dump().values())


class _Budget(NoBoolAsNumber):
    model_config = ConfigDict(frozen=True, extra="forbid")
    tokens_per_day: Allowance | None = None
    tokens_per_month: Allowance | None = None


class _Limits(NoBoolAsNumber):
    model_config = ConfigDict(frozen=True, extra="forbid")
    requests_per_minute: Allowance | None = None
    tokens_per_minute: Allowance | None = None


class KeyRequest(BaseModel):
    """`POST /admin/keys`: the body, checked at the edge."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tenant: Annotated[str, Field(min_length=1, max_length=200)]
    name: Annotated[str, Field(max_length=200), AfterValidator(_printable)] | None = None
    expires: (
        Annotated[float, BeforeValidator(parse_duration_s), Field(gt=0), AfterValidator(_lifetime)]
        | None
    ) = None
    budget: _Budget = _Budget()
    limits: _Limits = _Limits()

    def allowance(self) -> KeyAllowance:
        return KeyAllowance(**self.budget.model_dump(), **self.limits.model_dump())


@dataclass(frozen=True, slots=True)
class KeyRecord:
    id: str
    tenant: str
    digest: bytes
    created: float
    expires_at: float | None
    allowance: KeyAllowance
    name: str | None = None

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    @property
    def scope(self) -> str:
        """Where the key's own counters and buckets live: under its tenant's hash tag, so that
        a Redis Cluster keeps them in the tenant's slot."""
        return f"{tenant_scope(self.tenant)}:key:{self.id}"

    def public(self) -> dict[str, object]:
        """What the admin API shows: never the digest, never the secret."""
        allowance = self.allowance.model_dump()
        return {
            "id": self.id,
            "object": "api_key",
            "tenant": self.tenant,
            "name": self.name,
            "created": int(self.created),
            "expires_at": _shown_s(self.expires_at),
            "budget": {k: allowance[k] for k in ("tokens_per_day", "tokens_per_month")},
            "limits": {k: allowance[k] for k in ("requests_per_minute", "tokens_per_minute")},
        }

    def dumps(self) -> bytes:
        return orjson.dumps(
            {
                "tenant": self.tenant,
                "digest": "sha256:" + self.digest.hex(),
                "created": self.created,
                "expires_at": self.expires_at,
                "allowance": self.allowance.model_dump(exclude_none=True),
                "name": self.name,
            }
        )

    @classmethod
    def loads(cls, key_id: str, data: bytes) -> KeyRecord:
        raw = orjson.loads(data)
        return cls(
            id=key_id,
            tenant=str(raw["tenant"]),
            digest=bytes.fromhex(str(raw["digest"]).removeprefix("sha256:")),
            created=float(raw["created"]),
            expires_at=None if raw.get("expires_at") is None else float(raw["expires_at"]),
            allowance=KeyAllowance(**raw.get("allowance", {})),
            name=raw.get("name"),
        )


def _shown_s(epoch_s: float | None) -> int | None:
    return None if epoch_s is None else int(min(epoch_s, _LATEST_SHOWN_S))


def beyond_tenant(allowance: KeyAllowance, tenant: Tenant) -> list[str]:
    """The key's values above its tenant's own (a key lives within its tenant)."""
    own = {
        "tokens_per_day": tenant.budget.tokens_per_day,
        "tokens_per_month": tenant.budget.tokens_per_month,
        "requests_per_minute": tenant.limits.requests_per_minute,
        "tokens_per_minute": tenant.limits.tokens_per_minute,
    }
    return [
        f"{name} {value} is above the tenant's {own[name]}"
        for name, value in allowance.model_dump().items()
        if value is not None and own[name] is not None and value > own[name]
    ]
