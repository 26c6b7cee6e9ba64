"""The policy file: typed, frozen objects parsed once at startup from YAML."""

from proxy.policy.load import (
    PolicyError,
    Problem,
    decode_policy,
    load_policy,
    parse_policy,
    read_policy_bytes,
    read_policy_stream,
)
from proxy.policy.model import Backend, Budget, ModelSpec, Policy, Tenant

__all__ = [
    "Backend",
    "Budget",
    "ModelSpec",
    "Policy",
    "PolicyError",
    "Problem",
    "Tenant",
    "decode_policy",
    "load_policy",
    "parse_policy",
    "read_policy_bytes",
    "read_policy_stream",
]
