"""vLLM's chat fields that its template renders into the prompt count as input, end to end."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from proxy.app import create_app
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from tests.conftest import ALPHA_KEY
from tests.servers import serve
from tests.web.lyingbackend import lying_backend
from tests.web.test_billing import ledger_records, qwen_spec
from tests.web.test_budgets import KEY, budget_policy


def test_documents_and_template_variables_count_toward_the_input_limit(
    backend_url: str, backend: httpx.Client
) -> None:
    """A RAG template renders `documents` (and a template may render `chat_template_kwargs`)
    into the prompt, but only the messages were counted: 1,000 words of documents passed a
    20-token `max_input_tokens` to the backend uncounted."""
    with serve(create_app(budget_policy(backend_url, "{max_input_tokens: 20}"))) as url:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        before = backend.get("/mock/stats").json()["requests_total"]
        question = [{"role": "user", "content": "Summarise the notes."}]
        documents = [{"title": "notes", "text": "word " * 1000}]
        with pytest.raises(openai.BadRequestError) as caught:
            sdk.chat.completions.create(
                model="mock-llm", messages=question, extra_body={"documents": documents}
            )
        kwargs = {"chat_template_kwargs": {"persona": "word " * 1000}}
        with pytest.raises(openai.BadRequestError):
            sdk.chat.completions.create(model="mock-llm", messages=question, extra_body=kwargs)
        assert backend.get("/mock/stats").json()["requests_total"] == before
        fits = sdk.chat.completions.create(
            model="mock-llm",
            messages=question,
            extra_body={"documents": [{"text": "short"}], "chat_template_kwargs": {"x": True}},
        )
    assert caught.value.code == "context_length_exceeded"
    assert fits.choices


@pytest.mark.parametrize(
    "field",
    [
        {"documents": [{"word " * 1000: "notes"}]},
        {"chat_template_kwargs": {"custom_tools": [{"word " * 1000: {"type": "string"}}]}},
        {"chat_template_kwargs": {"custom_tools": [[0] * 1000]}},
    ],
    ids=["a document's key", "a template variable's key", "a template variable's numbers"],
)
def test_what_template_inputs_hold_beside_strings_counts_toward_the_input_limit(
    backend_url: str, backend: httpx.Client, field: dict[str, object]
) -> None:
    """A template renders the keys and numbers of what it is given too (Llama 3.1's
    `custom_tools` through `tojson`, Command-R's documents through `items()`), but only the
    strings were counted: 1,000 words in a key, or 1,000 zeros, passed a 20-token
    `max_input_tokens` uncounted."""
    with serve(create_app(budget_policy(backend_url, "{max_input_tokens: 20}"))) as url:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        question = [{"role": "user", "content": "Summarise the notes."}]
        with pytest.raises(openai.BadRequestError) as caught:
            sdk.chat.completions.create(model="mock-llm", messages=question, extra_body=field)
        assert backend.get("/mock/stats").json()["requests_total"] == 0
    assert caught.value.code == "context_length_exceeded"


def test_legacy_functions_count_toward_the_input_limit(
    backend_url: str, backend: httpx.Client
) -> None:
    """OpenAI renders the legacy `functions` into the prompt as it renders `tools`, and bills
    them, but only `tools` were counted: a function described in 1,000 words passed a 40-token
    `max_input_tokens` to the backend uncounted."""
    with serve(create_app(budget_policy(backend_url, "{max_input_tokens: 40}"))) as url:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        question = [{"role": "user", "content": "What is the weather?"}]
        hidden = [{"name": "weather", "description": "word " * 1000, "parameters": {}}]
        with pytest.raises(openai.BadRequestError) as caught:
            sdk.chat.completions.create(
                model="mock-llm", messages=question, extra_body={"functions": hidden}
            )
        assert backend.get("/mock/stats").json()["requests_total"] == 0
        small = [{"name": "weather", "description": "Today's weather.", "parameters": {}}]
        fits = sdk.chat.completions.create(
            model="mock-llm", messages=question, extra_body={"functions": small}
        )
    assert caught.value.code == "context_length_exceeded"
    assert fits.choices


@pytest.mark.parametrize(
    ("field", "param"),
    [
        ("chat_template", "chat_template"),
        ("chat_template_kwargs", "chat_template_kwargs.chat_template"),
    ],
)
def test_a_request_chat_template_is_refused_under_an_input_limit(
    backend_url: str, backend: httpx.Client, field: str, param: str
) -> None:
    """vLLM renders the messages through a chat template sent with the request (with
    --trust-request-chat-template), but the gateway counts them with the model's own: a
    template repeating a 5-token question 10,000 times passed a 40-token max_input_tokens."""
    template = "{% for i in range(10000) %}{{ messages[-1].content }}{% endfor %}"
    value: object = template if field == "chat_template" else {"chat_template": template}
    question = [{"role": "user", "content": "What is the weather?"}]
    with serve(create_app(budget_policy(backend_url, "{max_input_tokens: 40}"))) as url:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            sdk.chat.completions.create(
                model="mock-llm", messages=question, extra_body={field: value}
            )
        assert backend.get("/mock/stats").json()["requests_total"] == 0
        fits = sdk.chat.completions.create(
            model="mock-llm", messages=question, extra_body={"chat_template_kwargs": {"x": 1}}
        )
    assert (caught.value.code, caught.value.param) == ("unsupported_parameter", param)
    assert fits.choices
    with serve(create_app(budget_policy(backend_url, "{temperature: 0.2}"))) as url:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        uncounted = sdk.chat.completions.create(
            model="mock-llm", messages=question, extra_body={field: value}
        )
    assert uncounted.choices  # a key without an input limit passes it on untouched


def test_documents_are_billed_when_the_backend_reports_no_usage(tmp_path: Path) -> None:
    """A backend that reports no usage is billed the gateway's own count of the input, but for a
    key without limits (the count made only for the bill) that count left `documents` out: a
    request carrying 1,000 words of them was billed its 20-token question."""
    ledger = tmp_path / "ledger.db"
    with lying_backend() as (backend, backend_url):
        backend.usage = None
        text = f"""
storage: memory
ledger: sqlite:///{ledger}
backends: [{{name: liar, url: "{backend_url}/v1", models: [exact-llm]}}]
models: {{exact-llm: {{tokenizer: "{qwen_spec()}"}}}}
tenants:
  alpha: {{api_keys: [{hash_key(ALPHA_KEY)}], models: [exact-llm]}}
"""
        policy = parse_policy(text, file="bill.yaml", environ={})
        question = [{"role": "user", "content": "Summarise the notes."}]
        with serve(create_app(policy)) as url:
            sdk = openai.OpenAI(base_url=url + "/v1", api_key=ALPHA_KEY, max_retries=0)
            sdk.chat.completions.create(model="exact-llm", messages=question)
            documents = [{"title": "notes", "text": "word " * 1000}]
            sdk.chat.completions.create(
                model="exact-llm", messages=question, extra_body={"documents": documents}
            )
    plain, with_documents = ledger_records(ledger, 2)
    assert plain.usage_source == with_documents.usage_source == "counted"
    assert with_documents.input_tokens >= plain.input_tokens + 1000


def test_prompt_embeddings_are_refused_under_an_input_limit(
    backend_url: str, backend: httpx.Client
) -> None:
    """vLLM reads a completion's `prompt_embeds` (with --enable-prompt-embeds) as a prompt of as
    many tokens as the tensor has rows, beside or instead of the text prompt; the gateway
    counted only the text: an empty prompt and any embeddings passed a 40-token limit."""
    embeds = {"prompt_embeds": "UEsDBAAAAAAAAAAAAAAAAAAAAAAAAA=="}  # a torch.save'd tensor
    with serve(create_app(budget_policy(backend_url, "{max_input_tokens: 40}"))) as url:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            sdk.completions.create(model="mock-llm", prompt="", max_tokens=5, extra_body=embeds)
        assert backend.get("/mock/stats").json()["requests_total"] == 0
        fits = sdk.completions.create(model="mock-llm", prompt="Once", max_tokens=5)
    assert (caught.value.code, caught.value.param) == ("unsupported_parameter", "prompt_embeds")
    assert fits.choices
    with serve(create_app(budget_policy(backend_url, "{temperature: 0.2}"))) as url:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        passed = sdk.completions.create(
            model="mock-llm", prompt="Once", max_tokens=5, extra_body=embeds
        )
    assert passed.choices  # a key without an input limit passes it on untouched
