"""Prices from the policy as integers: what tokens cost, in nano-USD, without float drift."""

from __future__ import annotations

from proxy.policy.model import Policy, Tenant

__all__ = ["PriceTable"]

# Policy prices are USD per million tokens; kept here as pico-USD per token (1e-12 USD).
_PICO_PER_USD_PER_1M = 1_000_000


class PriceTable:
    def __init__(self, policy: Policy) -> None:
        self._rates = {
            name: (
                round(spec.price.input_per_1m * _PICO_PER_USD_PER_1M),
                round(spec.price.output_per_1m * _PICO_PER_USD_PER_1M),
            )
            for name, spec in policy.models.items()
        }
        # What a request for a model may end up costing: its fallback models may answer it.
        self._ceilings = {
            name: _ceiling([self._rates.get(m, (0, 0)) for m in (name, *spec.fallback_models)])
            for name, spec in policy.models.items()
        }
        # A tenant's degradation rules may send its request to another model (and its fallbacks)
        # after the reservation: the tenant's ceiling covers those models too.
        self._tenant_ceilings = {
            (tenant, name): _ceiling([self._ceilings[name], *(self._ceilings[t] for t in targets)])
            for tenant, spec in policy.tenants.items()
            if (targets := _switch_targets(spec))
            for name in policy.models
        }

    def cost_nusd(self, model: str, input_tokens: int, output_tokens: int) -> int:
        """What the tokens cost in nano-USD, rounded up (a reservation must not undershoot)."""
        return _nusd(self._rates.get(model, (0, 0)), input_tokens, output_tokens)

    def ceiling_nusd(
        self, model: str, input_tokens: int, output_tokens: int, tenant: str = ""
    ) -> int:
        """The most the tokens may cost on `tenant`'s request for `model`: at the dearest rates
        of the model, its fallback models, and the models the tenant's degradation rules may
        switch to (what a reservation must cover, whichever answers)."""
        rates = self._tenant_ceilings.get((tenant, model)) or self._ceilings.get(model, (0, 0))
        return _nusd(rates, input_tokens, output_tokens)


def _switch_targets(tenant: Tenant) -> set[str]:
    """The models `tenant`'s degradation rules may send a request to (shadow rules change
    nothing)."""
    if tenant.shadow:
        return set()
    return {
        rule.then.model
        for rule in tenant.degrade
        if rule.then.model is not None and not rule.shadow
    }


def _ceiling(rates: list[tuple[int, int]]) -> tuple[int, int]:
    return max(r[0] for r in rates), max(r[1] for r in rates)


def _nusd(rates: tuple[int, int], input_tokens: int, output_tokens: int) -> int:
    """Rounded up: a reservation must not undershoot."""
    pico = input_tokens * rates[0] + output_tokens * rates[1]
    return -(-pico // 1000)
