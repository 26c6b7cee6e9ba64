"""Which span path a set-up gets: tokenweir's own OTLP export records directly, anything else
(a user's provider, console, attribute limits, TOKENWEIR_TRACE_PATH=sdk) goes through the API."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider

from proxy.telemetry.directtrace import DirectTracing
from proxy.telemetry.ownprovider import OwnTracerProvider
from proxy.telemetry.sdk import start_sdk
from proxy.telemetry.tracing import Tracing, open_tracing

OTLP = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "direct"),
    [
        ({}, True),
        ({"TOKENWEIR_TRACE_PATH": "direct"}, True),
        ({"TOKENWEIR_TRACE_PATH": "SDK"}, False),
        ({"OTEL_TRACES_EXPORTER": "console"}, False),
        ({"OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT": "32"}, False),
        ({"OTEL_ATTRIBUTE_COUNT_LIMIT": "8"}, False),
    ],
)
def test_the_path_each_set_up_takes(extra: dict[str, str], direct: bool) -> None:
    sdk = start_sdk({**OTLP, **extra})
    try:
        provider = sdk.tracer_provider
        assert isinstance(provider, TracerProvider)  # an SDK provider either way
        assert isinstance(provider, OwnTracerProvider) is direct
        assert isinstance(open_tracing(provider), DirectTracing if direct else Tracing)
    finally:
        sdk.shutdown()


def test_a_users_own_provider_keeps_the_api_path() -> None:
    provider = TracerProvider()
    assert isinstance(open_tracing(provider), Tracing)
    provider.shutdown()


def test_an_unknown_trace_path_is_an_error() -> None:
    with pytest.raises(ValueError, match="TOKENWEIR_TRACE_PATH"):
        start_sdk({**OTLP, "TOKENWEIR_TRACE_PATH": "fast"})
