"""API keys managed at runtime: created and revoked through the admin API, stored hashed."""

from proxy.keys.record import KeyAllowance, KeyRecord, KeyRequest
from proxy.keys.runtime import RuntimeKeys

__all__ = ["KeyAllowance", "KeyRecord", "KeyRequest", "RuntimeKeys"]
