"""The request the gateway sends upstream, changed in one place: the client's body as parse read
it, and each change a stage makes to it through one method that keeps the body, the answer's
bound (`allowance`) and the shaping record (`shaped`) in step. A stage reads `body` and `model`
and never writes them itself."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["OutgoingRequest"]


class OutgoingRequest:
    """`bounds` are the body fields that cap the answer's length for the operation (proxy.apis
    `output_fields`); the last is the one a bound is set in when the body sets none."""

    __slots__ = ("allowance", "body", "bounds", "model", "shaped")

    def __init__(self, body: dict[str, Any], model: str = "", bounds: tuple[str, ...] = ()) -> None:
        self.body = body
        self.model = model
        self.bounds = bounds
        self.allowance: int | None = None  # the most output tokens the request may produce
        self.shaped: list[str] = []  # why the body differs from the client's, in order

    def set_model(self, name: str) -> None:
        """Send the request to `name` instead (a degradation rule, a fallback model)."""
        self.model = self.body["model"] = name

    def bound_output(self, limit: int, reason: str | None) -> None:
        """Bound the answer to `limit` tokens: each output field the body sets is lowered to it
        (never raised), and with none set the operation's own field is set to it. `reason`, a
        shaping name, is recorded once when the body changed."""
        body = self.body
        present = [name for name in self.bounds if body.get(name) is not None]
        changed = not present
        if not present:
            body[self.bounds[-1]] = limit
        for name in present:
            if body[name] > limit:
                body[name] = limit
                changed = True
        bound = self.output_bound()
        if self.allowance is not None and bound is not None:
            bound = min(bound, self.allowance)
        self.allowance = bound
        if changed and reason is not None:
            self.record(reason)

    def allow_as_sent(self) -> None:
        """The answer may be as long as the body's own bound (None: it sets none)."""
        self.allowance = self.output_bound()

    def output_bound(self) -> int | None:
        """The most output tokens the body allows (None: it sets no bound)."""
        values = [self.body[name] for name in self.bounds if self.body.get(name) is not None]
        return min(values) if values else None

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
