"""`routing: weighted`: several backends for one model take turns, by weight; each request
reaches exactly one."""

from __future__ import annotations

from contextlib import ExitStack

import httpx
import openai

from proxy.app import create_app
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from proxy.tools.mock import backend as mockbackend
from tests.servers import serve


def test_backends_take_turns_by_weight() -> None:
    with ExitStack() as stack:
        urls = [stack.enter_context(serve(mockbackend.create_app())) for _ in range(2)]
        policy = parse_policy(
            f"""
backends:
  - {{name: one, url: "{urls[0]}/v1", models: [m]}}
  - {{name: two, url: "{urls[1]}/v1", models: [m], weight: 2}}
models: {{m: {{routing: weighted}}}}
tenants:
  t: {{api_keys: [{hash_key("k")}], models: [m]}}
""",
            environ={},
        )
        gateway = stack.enter_context(serve(create_app(policy)))
        with openai.OpenAI(base_url=gateway + "/v1", api_key="k", max_retries=0) as sdk:
            for _ in range(9):
                sdk.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1
                )
        served = [httpx.get(url + "/mock/stats").json()["requests_total"] for url in urls]
    assert served == [3, 6]
