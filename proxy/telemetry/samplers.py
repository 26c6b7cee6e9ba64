"""Head sampling for the direct span path: the SDK's six standard samplers, the same decisions.

`OTEL_TRACES_SAMPLER` (default `parentbased_always_on`) and `OTEL_TRACES_SAMPLER_ARG` are read
as opentelemetry.sdk.trace.sampling reads them: an unknown name is `parentbased_always_on`
and a ratio that is missing, not a number or outside [0, 1] is 1.0, each with a warning. A
ratio keeps the traces whose id's low 64 bits fall under `ratio * 2**64`; a parent-based
sampler follows a client's sampled flag when the client sent a valid `traceparent`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from proxy.telemetry.w3c import SAMPLED, RemoteParent

__all__ = ["HeadSampler", "head_sampler"]

_log = logging.getLogger("tokenweir")
_LOW_64 = (1 << 64) - 1
_ALL = 1 << 64  # a bound every trace id's low 64 bits fall under
_RATIOS = ("traceidratio", "parentbased_traceidratio")
_FIXED = {
    "always_on": _ALL,
    "always_off": 0,
    "parentbased_always_on": _ALL,
    "parentbased_always_off": 0,
}


@dataclass(frozen=True, slots=True)
class HeadSampler:
    parent_based: bool
    root_bound: int  # a trace is kept when its id's low 64 bits are below this

    def sampled(self, trace_id: int, parent: RemoteParent | None) -> bool:
        if parent is not None and self.parent_based:
            return bool(parent.flags & SAMPLED)
        return trace_id & _LOW_64 < self.root_bound


def head_sampler(environ: Mapping[str, str]) -> HeadSampler:
    name = environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").lower()
    if name not in _FIXED and name not in _RATIOS:
        _log.warning("OTEL_TRACES_SAMPLER=%s is not known: parentbased_always_on", name)
        name = "parentbased_always_on"
    parent_based = name.startswith("parentbased_")
    if name in _FIXED:
        return HeadSampler(parent_based, _FIXED[name])
    return HeadSampler(parent_based, _ratio_bound(environ.get("OTEL_TRACES_SAMPLER_ARG", "")))


def _ratio_bound(text: str) -> int:
    try:
        ratio = float(text)
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(ratio)
    except ValueError:
        _log.warning("OTEL_TRACES_SAMPLER_ARG=%r is not a ratio in [0, 1]: 1.0", text)
        return _ALL
    return round(ratio * _ALL)  # TraceIdRatioBased.get_bound_for_rate
