"""A request that presents two different keys (two `Authorization` headers, or `Authorization`
and Anthropic's `x-api-key`) is refused 401 on every route that reads a key, through a real
gateway with the real SDKs: it never runs as whichever key came first, and bills nothing. A key
of UTF-8 text is read from a header as the bytes it was sent as."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from proxy.app import create_app
from proxy.policy import parse_policy
from tests.conftest import ADMIN_KEY, ALPHA_KEY, BETA_KEY
from tests.servers import serve

CHAT = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
TWO_KEYS = [("authorization", f"Bearer {ALPHA_KEY}"), ("authorization", f"Bearer {BETA_KEY}")]


def _refused_as_ambiguous(answer: httpx.Response) -> None:
    assert answer.status_code == 401, answer.text
    assert answer.json()["error"]["code"] == "ambiguous_api_key"


def test_two_authorization_headers_with_different_keys_are_refused(
    gateway_url: str, backend: httpx.Client
) -> None:
    with httpx.Client(base_url=gateway_url, timeout=10) as client:
        # Before, the first header won: alpha's key ran the chat, whatever a proxy added after it.
        _refused_as_ambiguous(client.post("/v1/chat/completions", json=CHAT, headers=TWO_KEYS))
        behind = [("authorization", f"Bearer {BETA_KEY}"), ("authorization", f"Bearer {ALPHA_KEY}")]
        _refused_as_ambiguous(client.post("/v1/chat/completions", json=CHAT, headers=behind))
        _refused_as_ambiguous(client.get("/v1/models", headers=TWO_KEYS))
        _refused_as_ambiguous(client.get("/api/usage", headers=TWO_KEYS))
        admin = [("authorization", f"Bearer {ALPHA_KEY}"), ("authorization", f"Bearer {ADMIN_KEY}")]
        _refused_as_ambiguous(client.get("/admin/keys", headers=admin))
    assert backend.get("/mock/stats").json()["requests_total"] == 0  # nothing reached it


def test_the_same_key_twice_is_one_key(gateway_url: str) -> None:
    same = [("authorization", f"Bearer {ALPHA_KEY}"), ("authorization", f"bearer  {ALPHA_KEY}")]
    with httpx.Client(base_url=gateway_url, timeout=10) as client:
        answer = client.post("/v1/chat/completions", json=CHAT, headers=same)
        assert answer.status_code == 200, answer.text
        # An empty header beside the key (a proxy's unset variable) presents no second key.
        empty = [("authorization", f"Bearer {ALPHA_KEY}"), ("x-api-key", ""), ("authorization", "")]
        assert client.get("/v1/models", headers=empty).status_code == 200


def _sdk(gateway_url: str, key: str, x_api_key: str) -> anthropic.Anthropic:
    """This anthropic SDK sends its key as `Authorization: Bearer`; `x_api_key` goes beside it
    (as a proxy's, or as older SDKs send their key)."""
    headers = {"x-api-key": x_api_key}
    return anthropic.Anthropic(
        base_url=gateway_url, api_key=key, default_headers=headers, max_retries=0
    )


def _hello(sdk: anthropic.Anthropic) -> anthropic.types.Message:
    return sdk.messages.create(
        model="mock-llm", max_tokens=3, messages=[{"role": "user", "content": "hi"}]
    )


def test_x_api_key_and_an_authorization_naming_another_key_are_refused(
    gateway_url: str, backend: httpx.Client
) -> None:
    # Before, Authorization won and x-api-key was ignored: beta's key, 403 on alpha's model.
    with _sdk(gateway_url, BETA_KEY, ALPHA_KEY) as sdk:
        with pytest.raises(anthropic.AuthenticationError) as refused:
            _hello(sdk)
        assert refused.value.status_code == 401
        assert "more than one API key" in str(refused.value)
        with pytest.raises(anthropic.AuthenticationError):
            sdk.models.list()
    assert backend.get("/mock/stats").json()["requests_total"] == 0


def test_x_api_key_and_an_authorization_naming_the_same_key_are_one_key(
    gateway_url: str,
) -> None:
    with _sdk(gateway_url, ALPHA_KEY, ALPHA_KEY) as sdk:
        assert _hello(sdk).content


NON_ASCII_KEY = "ключ-clé-voilà"  # à ends in 0xA0, which str.strip() took for a space
NON_ASCII_POLICY = """
backends: [{name: mock, url: "%s/v1", models: [mock-llm]}]
models: {mock-llm: {}}
tenants:
  gamma: {api_keys: ["${GAMMA_KEY}"], models: [mock-llm]}
"""


def test_a_key_of_utf8_text_works_in_headers_as_in_the_login_form(backend_url: str) -> None:
    """The policy hashes a key's UTF-8 bytes; a header's value was read as latin-1 text and
    hashed as UTF-8 again, so such a key logged in to the dashboard but got 401 on every API
    route."""
    text = NON_ASCII_POLICY % backend_url
    app = create_app(parse_policy(text, environ={"GAMMA_KEY": NON_ASCII_KEY}))
    sent = NON_ASCII_KEY.encode()
    with serve(app) as url, httpx.Client(base_url=url, timeout=10) as client:
        bearer = [(b"authorization", b"Bearer " + sent)]
        answer = client.get("/v1/models", headers=bearer)
        assert answer.status_code == 200, answer.text
        assert client.get("/v1/models", headers=[(b"x-api-key", sent)]).status_code == 200
        # The same text in another encoding is another key.
        wrong = [(b"authorization", b"Bearer " + "clé".encode("latin-1"))]
        assert client.get("/v1/models", headers=wrong).status_code == 401
        login = client.post("/dashboard/login", data={"key": NON_ASCII_KEY})
        assert login.status_code == 303
