"""Where and how spans are posted follows the OTLP exporter specification's variables."""

from __future__ import annotations

from proxy.telemetry.otlppost import otlp_settings


def test_settings_follow_the_specification() -> None:
    settings = otlp_settings(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "2500",
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "a=1, b = x%3Dy ,broken",
        }
    )
    assert settings.endpoint == "http://collector:4318/v1/traces"
    assert settings.timeout_s == 2.5
    assert settings.headers == {"a": "1", "b": "x=y"}
    assert settings.gzip is False
    signal = otlp_settings(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://traces.example:443/custom",
            "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "gzip",
        }
    )
    assert signal.endpoint == "https://traces.example:443/custom"
    assert signal.gzip is True
    assert otlp_settings({}).endpoint == "http://localhost:4318/v1/traces"
