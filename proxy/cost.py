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
        # What a request for a model may end up costing: its fallback models may answer it.
        self._ceilings = {
            name: _ceiling([self._rates.get(m, (0, 0)) for m in (name, *spec.fallback_models)])
            for name, spec in policy.models.items()
        }

    def cost_nusd(self, model: str, input_tokens: int, output_tokens: int) -> int:
        """What the tokens cost in nano-USD, rounded up (a reservation must not undershoot)."""
        return _nusd(self._rates.get(model, (0, 0)), input_tokens, output_tokens)

    def ceiling_nusd(self, model: str, input_tokens: int, output_tokens: int) -> int:
        """The most the tokens may cost on a request for `model`: at the dearest rates of the
        model and its fallback models (what a reservation must cover, whichever answers)."""
        return _nusd(self._ceilings.get(model, (0, 0)), input_tokens, output_tokens)


def _ceiling(rates: list[tuple[int, int]]) -> tuple[int, int]:
    return max(r[0] for r in rates), max(r[1] for r in rates)


def _nusd(rates: tuple[int, int], input_tokens: int, output_tokens: int) -> int:
    """Rounded up: a reservation must not undershoot."""
    pico = input_tokens * rates[0] + output_tokens * rates[1]
    return -(-pico // 1000)
