"""A stage says itself what else it is: a planner (its storage steps go in the prefetch's one
round trip), a settler (it holds something until the request ends) or traced (it gets a child
span when it used storage). The gateway derives the three lists from the stage list, so a new
stage is its file and one line in proxy/gateway.py."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import ClassVar

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy.clock import SystemClock
from proxy.context import Admitted
from proxy.stages import Stage
from proxy.stages.account import settlers_of
from proxy.stages.prefetch import Plan, planners_in
from proxy.telemetry.metrics import GatewayMetrics
from proxy.telemetry.recorder import Telemetry
from proxy.telemetry.tracing import open_tracing
from proxy.together import nothing
from tests.conftest import make_policy
from tests.contexts import admitted

pytestmark = pytest.mark.anyio


class Plain:
    async def __call__(self, ctx: Admitted) -> None:
        ctx.outgoing.shaped.append("plain")


class Holding:
    """Holds a slot from its run until the request is settled."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def __call__(self, ctx: Admitted) -> None:
        ctx.outgoing.shaped.append(self.name)

    def holding(self, ctx: Admitted) -> bool:
        return self.name in ctx.outgoing.shaped

    def settle(self, ctx: Admitted) -> Awaitable[None]:
        ctx.degraded.append(self.name)
        return nothing()


class Looked:
    """Traced: its span is drawn when the request carries its mark."""

    span_name: ClassVar[str] = "tokenweir.test.look"
    given_back_at_settle: ClassVar[bool] = True

    async def __call__(self, ctx: Admitted) -> None:
        return None

    def touched(self, ctx: Admitted) -> bool:
        return "look" in ctx.tags


def test_settlers_are_the_stages_that_hold_something_last_first() -> None:
    first, second = Holding("first"), Holding("second")
    stages: list[Stage] = [Plain(), first, Looked(), second, Plain()]
    assert settlers_of(stages) == [second, first]


def context(*tags: str) -> Admitted:
    ctx = admitted()
    ctx.tags = tags
    return ctx


def telemetry(exporter: InMemorySpanExporter | None) -> Telemetry:
    tracing = None
    if exporter is not None:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        tracing = open_tracing(provider)
    return Telemetry(
        make_policy("http://127.0.0.1:9"), SystemClock(), GatewayMetrics(), tracing=tracing
    )


def test_only_traced_stages_are_timed_and_only_when_tracing() -> None:
    looked = Looked()
    stages: list[Stage] = [Plain(), looked, Holding("h")]
    assert telemetry(None).timed_stages(stages) == [None, None, None]
    assert telemetry(InMemorySpanExporter()).timed_stages(stages) == [None, looked, None]


@pytest.mark.parametrize(("tags", "children"), [
    (("look",), ["tokenweir.test.look", "tokenweir.settle"]),
    ((), []),
])  # fmt: skip
async def test_a_traced_stage_draws_its_span_and_the_settle_span_when_it_touched_storage(
    tags: tuple[str, ...], children: list[str]
) -> None:
    exporter = InMemorySpanExporter()
    recorder = telemetry(exporter)
    looked = Looked()
    (timed,) = recorder.timed_stages([looked])
    assert timed is looked
    ctx = context(*tags)
    recorder.begin(ctx)
    await recorder.traced(ctx, looked)
    recorder.settle_ran(ctx, SystemClock().monotonic())
    assert ctx.trace is not None
    ctx.outcome.status = 200
    ctx.trace.finish(ctx, SystemClock().monotonic(), None)
    names = [span.name for span in exporter.get_finished_spans()]
    assert [name for name in names if name.startswith("tokenweir.")] == children


class Planning:
    """Plans storage steps for the prefetch's one round trip."""

    async def __call__(self, ctx: Admitted) -> None:
        return None

    def plan(self, ctx: Admitted) -> Plan | None:
        return None

    def replan(self, ctx: Admitted, plan: Plan) -> bool:
        return False


def test_planners_are_the_stages_that_plan_in_their_order() -> None:
    first, second = Planning(), Planning()
    stages: list[Stage] = [Plain(), first, Holding("h"), second]
    assert planners_in(stages) == [first, second]
