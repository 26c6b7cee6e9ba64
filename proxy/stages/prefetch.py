"""One storage round trip for the admission stages that follow it (budgets, rate limits, a key's
allowance, the exact cache lookup): each plans its storage steps, storage takes them together,
and each stage then reads its own outcomes as if it had called its store itself.

Writes planned. Storage takes the steps in stage order and stops after the first that refuses
or fails, so what is applied is what the stages' own calls, one after another, would apply.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from proxy.context import Admitted
from proxy.holds import Planned
from proxy.stages.storagepolicy import StorageFailures
from proxy.storage.facade import Storage
from proxy.storage.joint import Step

__all__ = ["Plan", "Planner", "Prefetch", "planners_in", "taken"]

P = TypeVar("P")
# A stage that shortens the request after a refusal (stop_stream_at_budget) has every stage
# plan again; one shortening per quota at most, as Budgets allows on its own.
_ROUNDS = 5


class Plan(Protocol):
    @property
    def steps(self) -> Sequence[Step[Any]]:
        """The storage steps the stage takes, in its order."""


@runtime_checkable
class Planner(Protocol):
    def plan(self, ctx: Admitted) -> Plan | None:
        """The stage's storage steps for `ctx` as it stands; None when it takes none."""

    def replan(self, ctx: Admitted, plan: Plan) -> bool:
        """After the steps were taken: True when the stage changed the request in answer (a
        shorter answer that fits a quota), so that every stage plans again."""


def planners_in(stages: Sequence[object]) -> list[Planner]:
    """The stages that plan storage steps for the prefetch's one round trip, in their order."""
    return [stage for stage in stages if isinstance(stage, Planner)]


def taken(ctx: Admitted, kind: type[P]) -> P | None:
    """The stage's plan with its outcomes, if the prefetch made one for it."""
    return ctx.planned.take(kind) if ctx.planned is not None else None


class Prefetch:
    def __init__(
        self, storage: Storage, planners: Sequence[Planner], failures: StorageFailures
    ) -> None:
        self._storage = storage
        self._planners = tuple(planners)
        self._failures = failures

    async def __call__(self, ctx: Admitted) -> None:
        plans: list[tuple[Planner, Plan]] = []
        for _ in range(_ROUNDS):
            plans = [(p, plan) for p in self._planners if (plan := p.plan(ctx)) is not None]
            steps = [step for _, plan in plans for step in plan.steps]
            if not steps:
                return
            # Shielded from the client's leaving: a call cancelled while Redis runs it would
            # take a slot and a reservation that no one records, so no one gives them back
            # until their leases end; its outcome is kept, and what it took settled as usual.
            with ctx.scope.shielded():
                await self._storage.admit(steps)
            self._undo_late(steps)
            if not any(planner.replan(ctx, plan) for planner, plan in plans):
                break
        ctx.planned = Planned(plan for _, plan in plans)

    def _undo_late(self, steps: Sequence[Step[Any]]) -> None:
        """A call that timed out may still be applied once storage catches up: what its steps
        hold is given back then (the stages only apply their failure policy)."""
        for step in steps:
            if step.error is not None and (undo := step.undo_in(self._storage)) is not None:
                self._failures.undo_later(step.error, *undo)
