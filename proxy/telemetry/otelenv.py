"""Does the environment ask for OpenTelemetry export? Read without importing the SDK.

Off unless configured: an exporter named in `OTEL_TRACES_EXPORTER` / `OTEL_METRICS_EXPORTER`
(`otlp` or `console`), or an OTLP endpoint set while those are unset. `OTEL_SDK_DISABLED=true`
and the exporter `none` turn it off.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["exporters_wanted", "otel_wanted"]

_KNOWN = ("otlp", "console")


def exporters_wanted(environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(traces exporter, metrics exporter), each `otlp`, `console` or None for off."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None, None
    endpoint = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return (
        _exporter(environ, "TRACES", endpoint),
        _exporter(environ, "METRICS", endpoint),
    )


def otel_wanted(environ: Mapping[str, str]) -> bool:
    return exporters_wanted(environ) != (None, None)


def _exporter(environ: Mapping[str, str], signal: str, endpoint: str | None) -> str | None:
    named = environ.get(f"OTEL_{signal}_EXPORTER", "").strip().lower()
    if named:
        first = named.split(",")[0].strip()
        if first not in _KNOWN and first != "none":
            raise ValueError(
                f"OTEL_{signal}_EXPORTER={named!r}: tokenweir knows otlp, console, none"
            )
        return first if first in _KNOWN else None
    if endpoint or environ.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT"):
        return "otlp"
    return None
