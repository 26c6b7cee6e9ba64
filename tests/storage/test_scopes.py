"""Whose keys a scope's are: read back as made, a tenant named like a backend still a tenant."""

from __future__ import annotations

from proxy.storage.scopes import backend_scope, scope_owner, tenant_scope


def test_a_scope_reads_back_as_whose_it_was_made() -> None:
    assert scope_owner(tenant_scope("acme")) == ("tenant", "acme")
    assert scope_owner(backend_scope("vllm")) == ("backend", "vllm")
    # The backend's scope is not a tenant's named "backend:vllm", nor the other way round.
    assert scope_owner(tenant_scope("backend:vllm")) == ("tenant", "backend:vllm")
    assert tenant_scope("backend:vllm") != backend_scope("vllm")


def test_a_runtime_keys_scope_is_no_tenants_nor_backends() -> None:
    """Its limits are its own and a reload does not resize them."""
    assert scope_owner(tenant_scope("acme") + ":key:k1") is None
    assert scope_owner("tw:{sessions}:ended:ab") is None
