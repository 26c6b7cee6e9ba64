"""The direct path samples as the SDK does, for its six standard samplers and their odd inputs."""

from __future__ import annotations

import random
from functools import partial

import pytest
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from proxy.telemetry.samplers import head_sampler
from proxy.telemetry.w3c import remote_parent
from tests.conftest import make_policy
from tests.telemetry.test_directtrace import answered
from tests.telemetry.twopaths import context, sdk_sampler, via_api, via_direct

ENVIRONS = (
    [
        {"OTEL_TRACES_SAMPLER": name, "OTEL_TRACES_SAMPLER_ARG": arg}
        for name in ("always_on", "always_off", "parentbased_always_on", "parentbased_always_off")
        for arg in ("", "0.5")
    ]
    + [
        {"OTEL_TRACES_SAMPLER": name, "OTEL_TRACES_SAMPLER_ARG": arg}
        for name in ("traceidratio", "parentbased_traceidratio", "TraceIdRatio")
        for arg in ("0.25", "0", "1", "0.999999", "1e-9", "", "half", "1.5", "-0.1", "nan", "inf")
    ]
    + [
        {},  # the default: parentbased_always_on
        {"OTEL_TRACES_SAMPLER": "xray"},  # unknown: the SDK warns and uses parentbased_always_on
        {"OTEL_TRACES_SAMPLER": "traceidratio"},  # no ratio: 1.0
    ]
)
FLAGS = ("00", "01", "02", "03", "ff")


def trace_ids(count: int) -> list[int]:
    """Random ids, and ids whose low 64 bits sit at the edges of common ratios' bounds."""
    chance = random.Random(16)  # noqa: S311 (test data)
    edges = [0, 1, (1 << 62) - 1, 1 << 62, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]
    high = [chance.getrandbits(64) << 64 for _ in edges]
    return [h | e for h, e in zip(high, edges, strict=True)] + [
        chance.getrandbits(128) or 1 for _ in range(count)
    ]


@pytest.mark.parametrize("environ", ENVIRONS, ids=lambda e: "/".join(e.values()) or "default")
def test_decisions_match_the_sdk_over_many_trace_ids(environ: dict[str, str]) -> None:
    ours, theirs = head_sampler(environ), sdk_sampler(environ)
    propagator = TraceContextTextMapPropagator()
    for trace_id in trace_ids(1500):
        root = theirs.should_sample(None, trace_id, "chat mock-llm").decision.is_sampled()
        assert ours.sampled(trace_id, None) is root, hex(trace_id)
        for flags in FLAGS:
            headers = {"traceparent": f"00-{trace_id:032x}-00f067aa0ba902b7-{flags}"}
            parent = remote_parent(headers)
            assert parent is not None
            expected = theirs.should_sample(
                propagator.extract(headers), trace_id, "chat mock-llm"
            ).decision.is_sampled()
            assert ours.sampled(trace_id, parent) is expected, (hex(trace_id), flags)


@pytest.mark.parametrize("environ", ENVIRONS[::3], ids=lambda e: "/".join(e.values()) or "default")
def test_whole_requests_match_the_sdk(environ: dict[str, str]) -> None:
    """Spans and the backend's traceparent (sampled and random-id flags) alike, end to end."""
    policy = make_policy("http://127.0.0.1:9")
    parents = [{}] + [
        {"traceparent": f"00-{random.Random(f).getrandbits(128):032x}-00f067aa0ba902b7-{f}"}  # noqa: S311
        for f in FLAGS
    ]
    for seed in range(40):
        for headers in parents:
            make = partial(context, policy, "alpha", headers)
            api = via_api(environ, seed, make, answered)
            direct = via_direct(environ, seed, make, answered)
            assert direct.headers == api.headers
            assert direct.spans == api.spans
