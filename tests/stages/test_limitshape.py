"""The size a reloaded policy gives a bucket or slot pool a request admitted before it holds."""

from __future__ import annotations

from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from proxy.stages.limitshape import sized_now
from proxy.storage.limits import LimitKey
from proxy.storage.scopes import backend_scope

POLICY = parse_policy(
    """
storage: memory
backends:
  - {name: vllm, url: "http://127.0.0.1:9/v1", models: [m], limits: {tokens_per_minute: 7000}}
models: {m: {}}
tenants:
  acme:
    api_keys: ["{A}"]
    models: [m]
    limits:
      requests_per_minute: 30
      tokens_per_minute: 5000
      max_concurrent: 4
      per_model: {m: {tokens_per_minute: 900}}
  plain: {api_keys: ["{B}"], models: [m]}
""".replace("{A}", hash_key("tw-acme")).replace("{B}", hash_key("tw-plain"))
)


def test_a_bucket_takes_the_size_of_its_limit_in_the_policy_serving_now() -> None:
    tokens, requests = LimitKey("tw:{acme}", "tokens"), LimitKey("tw:{acme}", "requests")
    on_model = LimitKey("tw:{acme}", "tokens", "m")
    backend = POLICY.backends[0]
    on_backend = LimitKey(backend_scope(backend.name), "tokens")
    assert sized_now(POLICY, tokens.bucket(1000)) == tokens.bucket(5000)
    assert sized_now(POLICY, requests.bucket(10)) == requests.bucket(30)
    assert sized_now(POLICY, on_model.bucket(100)) == on_model.bucket(900)
    assert sized_now(POLICY, on_backend.bucket(50)) == on_backend.bucket(7000)
    slots = LimitKey("tw:{acme}", "slots")
    assert sized_now(POLICY, slots.pool(1)) == slots.pool(4)


def test_a_bucket_whose_limit_is_gone_keeps_its_size() -> None:
    for key in (
        LimitKey("tw:{gone}", "tokens"),  # a tenant the reload removed
        LimitKey("tw:{plain}", "tokens"),  # a limit it removed
        LimitKey("tw:{acme}", "tokens", "other"),  # a model without a limit of its own
        LimitKey("tw:backend:{gone}", "tokens"),
    ):
        assert sized_now(POLICY, key.bucket(1000)) == key.bucket(1000)
    slots = LimitKey("tw:{plain}", "slots")
    assert sized_now(POLICY, slots.pool(2)) == slots.pool(2)
    assert sized_now(None, slots.pool(2)) == slots.pool(2)  # no policy known: as it is
