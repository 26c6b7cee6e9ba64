"""Kept encodings give the bytes encoding afresh gives, however often values repeat or change."""

from __future__ import annotations

from proxy.telemetry.attrwire import AttributeWriter
from proxy.telemetry.protowire import attributes

VALUES: list[dict[str, object]] = [
    {"gen_ai.operation.name": "chat", "gen_ai.request.stream": True, "server.port": 8000,
     "gen_ai.usage.input_tokens": 1, "tokenweir.ttft_s": 0.0123, "empty": "", "gone": None,
     "gen_ai.response.finish_reasons": ["stop", "length"], "tuple": ("a",)},
    # The same keys with values of other types that compare equal (True == 1 == 1.0).
    {"gen_ai.operation.name": "chat", "gen_ai.request.stream": 1, "server.port": True,
     "gen_ai.usage.input_tokens": 1.0, "tokenweir.ttft_s": -0.0, "empty": None, "gone": "x"},
    {"tokenweir.request_id": "é" * 300, "k" * 200: 2.5, "big": 2**62, "negative": -5,
     "gen_ai.response.finish_reasons": ["stop"], "url.full": "http://10.0.0.7:8000/v1/" + "p" * 90},
]  # fmt: skip


def test_every_call_gives_the_fresh_encoding() -> None:
    for kept in (1, 2, 4096):  # tiny caches are cleared again and again
        writer = AttributeWriter(kept)
        for _ in range(3):
            for values in VALUES:
                assert writer.pairs(values.items()) == attributes(0x4A, values), (kept, values)
