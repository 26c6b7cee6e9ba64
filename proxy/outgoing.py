"""The request the gateway sends upstream, changed in one place: the client's body as parse read
it, and each change a stage makes to it through one method that keeps the body, the answer's
bound (`allowance`) and the shaping record (`shaped`) in step. A stage reads `body` and `model`
and never writes them itself."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["DEFAULT_OUTPUT_BOUND", "OutgoingRequest"]

# Without a bound on output a reservation could be overspent; this is the bound a request that
# reserves output tokens gets when neither the client nor `max_output_tokens` set one.
DEFAULT_OUTPUT_BOUND = 4096


class OutgoingRequest:
    """`bounds` are the body fields that cap each answer's length for the operation (proxy.apis
    `output_fields`); the last is the one every backend of the operation reads, so a bound the
    gateway holds the answer to is always written there. `answers` is how many answers the
    backend generates (chat's `n`; a completions batch's prompts times `n` or `best_of`), and
    `choices` how many of them the client gets (the prompts times `n`).
    `default` is the bound the API gives an answer whose body sets none (completions: 16), which
    a bound the gateway sets in its place never exceeds."""

    __slots__ = (
        "allowance", "answers", "asked_model", "body", "bounds", "choices", "default", "model",
        "planned_bound", "shaped",
    )  # fmt: skip

    def __init__(
        self,
        body: dict[str, Any],
        model: str = "",
        bounds: tuple[str, ...] = (),
        default: int | None = None,
    ) -> None:
        self.body = body
        self.model = model
        self.asked_model = model  # the client's, whatever model serves the request
        self.bounds = bounds
        self.default = default
        self.allowance: int | None = None  # the most output tokens one answer may have
        # A bound a later stage writes (a degradation rule, chosen before admission), which
        # what is reserved counts on already.
        self.planned_bound: int | None = None
        self.answers = 1
        self.choices = 1
        self.shaped: list[str] = []  # why the body differs from the client's, in order

    def set_model(self, name: str) -> None:
        """Send the request to `name` instead (a degradation rule, a fallback model)."""
        self.model = self.body["model"] = name

    def bound_output(self, limit: int, reason: str | None) -> bool:
        """Bound each answer to `limit` tokens: each output field the body sets is lowered to it
        (never raised), and the operation's own field carries the bound (set to it, or to the
        API's lower default, when the body sets no field). `reason`, a shaping name, is recorded
        once when a bound was lowered or set. True when the answer's bound is now lower than
        the body's own was (an API default no higher than `limit` bounded it already)."""
        body = self.body
        bound: int | None = None
        changed = False
        for name in self.bounds:
            value = body.get(name)
            if value is None:
                continue
            if value > limit:
                body[name] = value = limit
                changed = True
                _fit_thinking(body, limit)
            bound = value if bound is None or value > bound else bound
        lowered = changed
        if bound is None:
            default = self.default
            bound, changed = limit if default is None else min(limit, default), True
            lowered = default is None or default > limit
        self._carry(bound)
        if self.allowance is not None:
            bound = min(bound, self.allowance)
        self.allowance = bound
        if changed and reason is not None:
            self.record(reason)
        return lowered

    def allow_as_sent(self, *, held: bool = False) -> None:
        """Each answer may be as long as the body's own bound (None: it sets none). `held`: a
        reservation counts on that bound, so the operation's own field carries it too."""
        self.allowance = bound = self.output_bound()
        if held and bound is not None:
            self._carry(bound)

    def output_bound(self) -> int | None:
        """The most output tokens an answer may have by the body (None: it sets no bound): of
        chat's two fields, a backend may read either, so the larger."""
        values = [self.body[name] for name in self.bounds if self.body.get(name) is not None]
        return max(values) if values else None

    def reserved_output(self) -> int | None:
        """The most output tokens the whole request may produce: every answer at its bound."""
        bound = self._reserved_bound()
        return None if bound is None else bound * self.answers

    def held_output(self) -> int:
        """The output tokens a reservation holds: every answer at its bound. A request with no
        bound is bounded to DEFAULT_OUTPUT_BOUND first, so the backend is held to what is
        reserved (a quota, a key's own allowance: one bound, whichever reserves first), or to
        the API's own default where it is lower (a completion's 16)."""
        if self.allowance is None:
            self.bound_output(DEFAULT_OUTPUT_BOUND, "max_tokens")
        return (self._reserved_bound() or 0) * self.answers

    def _reserved_bound(self) -> int | None:
        """Each answer's bound as reservations count it: the planned one, if lower."""
        bound, planned = self.allowance, self.planned_bound
        if planned is None:
            return bound
        return planned if bound is None else min(bound, planned)

    def _carry(self, bound: int) -> None:
        """The field every backend reads carries the bound where the client left it unset."""
        own = self.bounds[-1]
        if self.body.get(own) is None:
            self.body[own] = bound

    def set_messages(self, messages: Sequence[Any], reasons: Sequence[str]) -> None:
        """The chat messages sent instead of the client's, for `reasons` (shaping names)."""
        self.body["messages"] = messages
        for reason in reasons:
            self.record(reason)

    def set_field(self, name: str, value: Any, reason: str) -> None:
        """One field of the body replaced (the temperature bounded), recorded as `reason`."""
        self.body[name] = value
        self.record(reason)

    def record(self, reason: str) -> None:
        """Note a shaping of the body, once (the body was changed in place, as a system prompt
        put first by an agent API's own rules)."""
        if reason not in self.shaped:
            self.shaped.append(reason)


# Anthropic's extended thinking: `budget_tokens` is at least this, and below `max_tokens`.
_LEAST_THINKING = 1024


def _fit_thinking(body: dict[str, Any], bound: int) -> None:
    """A Messages body whose `max_tokens` the gateway lowered to `bound` keeps its extended
    thinking below it: `thinking.budget_tokens` must stay under `max_tokens`, or Anthropic (and
    backends that check as it does) refuse a request the client wrote correctly. Lowered to
    `bound - 1`, or, where that is below the least budget Anthropic takes, thinking is left out
    (the answer could not hold the least thinking anyway)."""
    thinking = body.get("thinking")
    if not isinstance(thinking, dict):
        return
    budget = thinking.get("budget_tokens")
    if type(budget) is not int or budget < bound:
        return
    if bound - 1 >= _LEAST_THINKING:
        body["thinking"] = {**thinking, "budget_tokens": bound - 1}
    else:
        del body["thinking"]
