"""Prices from the policy as integers: what tokens cost, in nano-USD, without float drift."""

from __future__ import annotations

from proxy.policy.model import Policy

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

    def cost_nusd(self, model: str, input_tokens: int, output_tokens: int) -> int:
        """What the tokens cost in nano-USD, rounded up (a reservation must not undershoot)."""
        input_rate, output_rate = self._rates.get(model, (0, 0))
        pico = input_tokens * input_rate + output_tokens * output_rate
        return -(-pico // 1000)
