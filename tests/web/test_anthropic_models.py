"""`GET /v1/models` for Anthropic's SDK: its key header, its `ModelInfo` shape, its paging."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.conftest import ALPHA_KEY, BETA_KEY


def sdk(gateway_url: str, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway_url, api_key=key, max_retries=0)


def test_the_anthropic_sdk_lists_and_pages_only_the_tenants_models(gateway_url: str) -> None:
    # The SDK sends its key in x-api-key: the list was a 401, and in OpenAI's shape besides.
    with sdk(gateway_url, ALPHA_KEY) as client:
        page = client.models.list()
        assert [(m.id, m.type, m.display_name) for m in page.data] == [
            ("mock-llm", "model", "mock-llm"),
            ("mock-embed", "model", "mock-embed"),
        ]
        assert (page.first_id, page.last_id, page.has_more) == ("mock-llm", "mock-embed", False)
        assert page.data[0].created_at.year >= 2026
        first = client.models.list(limit=1)
        assert ([m.id for m in first.data], first.has_more) == (["mock-llm"], True)
        assert [m.id for m in client.models.list(limit=1)] == ["mock-llm", "mock-embed"]
        before = client.models.list(before_id="mock-embed")
        assert ([m.id for m in before.data], before.has_more) == (["mock-llm"], False)
    with sdk(gateway_url, BETA_KEY) as client:
        assert [m.id for m in client.models.list()] == ["mock-small"]


def test_one_model_and_the_refusals_are_in_anthropics_shape(gateway_url: str) -> None:
    with sdk(gateway_url, ALPHA_KEY) as client:
        assert client.models.retrieve("mock-llm").id == "mock-llm"
        with pytest.raises(anthropic.NotFoundError) as hidden:
            client.models.retrieve("mock-small")  # another tenant's model is not shown to exist
        with pytest.raises(anthropic.BadRequestError) as cursor:
            client.models.list(after_id="mock-small")
        with pytest.raises(anthropic.BadRequestError):
            client.models.list(limit=1001)
    with sdk(gateway_url, "tw-no-such-key") as client, pytest.raises(anthropic.AuthenticationError):
        client.models.list()
    assert hidden.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": hidden.value.body["error"]["message"]},
    }
    assert "after_id 'mock-small' is not a model of this key" in str(cursor.value)
    # Without anthropic-version the answer is OpenAI's, whichever header holds the key.
    openai_shaped = httpx.get(gateway_url + "/v1/models", headers={"x-api-key": ALPHA_KEY})
    assert openai_shaped.json()["object"] == "list"
