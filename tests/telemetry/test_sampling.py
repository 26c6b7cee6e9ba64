"""A sampler that leaves a request out: nothing recorded, the decision passed to the backend."""

from __future__ import annotations

import openai
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

from proxy.app import create_app
from proxy.telemetry.sdk import OtelSdk
from proxy.tools.mock import backend as mockbackend
from tests.conftest import ALPHA_KEY, make_policy
from tests.servers import serve
from tests.telemetry.conftest import HeaderRecorder

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_sampled_out_requests_record_nothing_and_say_so_upstream() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(ALWAYS_OFF))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    backend = HeaderRecorder(mockbackend.create_app(ttft_ms=0, tokens_per_second=2000))
    with serve(backend) as backend_url:
        app = create_app(make_policy(backend_url), otel=OtelSdk(provider))
        with serve(app) as url:
            with openai.OpenAI(base_url=url + "/v1", api_key=ALPHA_KEY, max_retries=0) as client:
                messages = [{"role": "user", "content": "hi"}]
                for headers in ({}, {"traceparent": PARENT}):
                    list(client.chat.completions.create(
                        model="mock-llm", messages=messages, max_tokens=3,  # type: ignore[arg-type]
                        stream=True, extra_headers=headers,
                    ))  # fmt: skip
    provider.shutdown()
    sampled_out, continued = backend.seen
    # Left out: the backend is told not to sample either (the sampled bit of the flags is 0)
    # and no span was exported. A client's sampled trace is continued (parent-based).
    assert int(sampled_out["traceparent"].rsplit("-", 1)[1], 16) & 1 == 0
    assert continued["traceparent"].startswith("00-0af7651916cd43dd8448eb211c80319c-")
    assert int(continued["traceparent"].rsplit("-", 1)[1], 16) & 1 == 1
    names = sorted(span.name for span in exporter.get_finished_spans())
    assert names == ["POST /chat/completions", "chat mock-llm"]
    assert all(span.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
               for span in exporter.get_finished_spans())  # fmt: skip
