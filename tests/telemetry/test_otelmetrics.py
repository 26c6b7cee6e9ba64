"""With a meter provider configured, the same figures go out as OpenTelemetry GenAI metrics."""

from __future__ import annotations

import openai
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader

from proxy.app import create_app
from proxy.telemetry.sdk import OtelSdk
from tests.conftest import ALPHA_KEY, make_policy
from tests.servers import serve


def test_genai_histograms_with_the_specs_boundaries(backend_url: str) -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    app = create_app(make_policy(backend_url), otel=OtelSdk(None, provider))
    with serve(app) as url:
        with openai.OpenAI(base_url=url + "/v1", api_key=ALPHA_KEY, max_retries=0) as client:
            list(client.chat.completions.create(
                model="mock-llm", messages=[{"role": "user", "content": "hi"}], max_tokens=9,
                stream=True,
            ))  # fmt: skip
    data = reader.get_metrics_data()
    provider.shutdown()
    assert data is not None
    metrics = {
        m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
    }
    usage = metrics["gen_ai.client.token.usage"]
    points = {p.attributes["gen_ai.token.type"]: p for p in usage.data.data_points}  # type: ignore[index]
    output = points["output"]
    assert isinstance(output, HistogramDataPoint)
    assert output.sum == 9
    assert output.explicit_bounds[:4] == (1, 4, 16, 64)
    assert output.attributes is not None
    assert output.attributes["gen_ai.operation.name"] == "chat"
    assert output.attributes["gen_ai.request.model"] == "mock-llm"
    assert output.attributes["tokenweir.tenant"] == "alpha"
    for name in (
        "gen_ai.server.time_to_first_token",
        "gen_ai.client.operation.duration",
        "gen_ai.client.operation.time_to_first_chunk",
        "gen_ai.server.request.duration",
    ):
        [point] = metrics[name].data.data_points  # type: ignore[union-attr]
        assert point.count == 1, name  # type: ignore[union-attr]
