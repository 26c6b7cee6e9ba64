"""Policy files: typed and frozen when right; every problem named by file, line and key."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from proxy.app import DEFAULT_POLICY
from proxy.policy import PolicyError, load_policy, parse_policy
from proxy.policy.units import hash_key

KEY = hash_key("k")

GOOD = f"""\
storage: memory
backends:
  - name: a
    url: http://127.0.0.1:8000/v1/
    api_key: ${{UPSTREAM}}
    models: [m1, m2]
  - name: b
    url: http://127.0.0.1:8001/v1
    models: [m1]
    weight: 3
models:
  m1:
    tokenizer: tiktoken:o200k_base
    price: {{input_per_1m: 0.10, output_per_1m: 0.40}}
  m2: {{}}
tenants:
  support-bot:
    api_keys: [{KEY}]
    models: [m1]
    budget:
      system_prompt: 你是智能客服助手，请用简洁中文回答用户问题。
      max_output_tokens: 512
      history_limit: 10
    limits: {{requests_per_minute: 600, queue_timeout: 2s}}
    cache: {{mode: semantic, similarity: 0.92, ttl: 1h}}
    degrade:
      - name: shorten-under-load
        when: {{inflight_ratio_above: 0.8}}
        then: {{max_output_tokens: 128}}
"""


def problems(text: str, environ: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(PolicyError) as caught:
        parse_policy(
            text, file="p.yaml", environ={"UPSTREAM": "secret"} if environ is None else environ
        )
    return [str(p) for p in caught.value.problems]


def test_good_policy_resolves_units_and_references() -> None:
    policy = parse_policy(GOOD, file="p.yaml", environ={"UPSTREAM": "secret"})
    a, _ = policy.backends
    assert a.url == "http://127.0.0.1:8000/v1"
    assert a.api_key is not None
    assert a.api_key.get_secret_value() == "secret"
    assert "secret" not in repr(policy)
    assert [x.name for x in policy.backends_for("m1")] == ["a", "b"]
    tenant = policy.tenants["support-bot"]
    assert tenant.limits.queue_timeout == 2.0
    assert tenant.cache.ttl == 3600.0
    assert tenant.budget.system_prompt is not None
    assert tenant.budget.system_prompt.startswith("你是")
    with pytest.raises(ValidationError):
        tenant.models = ("m2",)  # type: ignore[misc]


def test_unknown_key_names_file_line_and_path() -> None:
    text = GOOD.replace("      history_limit: 10\n", "      history_limit: 10\n      histroy: 3\n")
    assert problems(text) == ["p.yaml:24: tenants.support-bot.budget.histroy: unknown key"]


def test_a_misspelt_key_names_the_key_meant() -> None:
    """ "unknown key" left the operator to find the spelling in the docs."""
    text = (
        GOOD.replace("max_output_tokens: 512", "max_ouput_tokens: 512")
        .replace("requests_per_minute: 600", "requests_per_minut: 600")
        .replace("inflight_ratio_above: 0.8", "inflight_ratio_abov: 0.8")
        .replace("storage: memory", "storge: memory")
    )
    assert problems(text) == [
        "p.yaml:1: storge: unknown key (did you mean storage?)",
        "p.yaml:22: tenants.support-bot.budget.max_ouput_tokens: unknown key "
        "(did you mean max_output_tokens?)",
        "p.yaml:24: tenants.support-bot.limits.requests_per_minut: unknown key "
        "(did you mean requests_per_minute?)",
        "p.yaml:28: tenants.support-bot.degrade[0].when.inflight_ratio_abov: unknown key "
        "(did you mean inflight_ratio_above?)",
    ]


def test_wrong_types_and_units_are_named() -> None:
    text = GOOD.replace("max_output_tokens: 512", "max_output_tokens: lots").replace(
        "queue_timeout: 2s", "queue_timeout: 2 parsecs"
    )
    found = problems(text)
    assert found[0].startswith("p.yaml:22: tenants.support-bot.budget.max_output_tokens: ")
    assert found[1].startswith(
        "p.yaml:24: tenants.support-bot.limits.queue_timeout: expected a duration"
    )


def test_true_or_false_is_not_a_number() -> None:
    """YAML's booleans never pass as 1 or 0 in a number's place; switches still take them."""
    text = (
        GOOD.replace("history_limit: 10", "history_limit: false")
        .replace("requests_per_minute: 600", "requests_per_minute: true")
        .replace("similarity: 0.92", "similarity: true")
        .replace(
            "      max_output_tokens: 512\n",
            "      max_output_tokens: 512\n"
            "      tokens_per_day: true\n      stop_stream_at_budget: true\n",
        )
    )
    assert problems(text) == [
        "p.yaml:23: tenants.support-bot.budget.tokens_per_day: expected a number, not true",
        "p.yaml:25: tenants.support-bot.budget.history_limit: expected a number, not false",
        "p.yaml:26: tenants.support-bot.limits.requests_per_minute: expected a number, not true",
        "p.yaml:27: tenants.support-bot.cache.similarity: expected a number, not true",
    ]
    switches = GOOD.replace("history_limit: 10", "history_limit: 10\n      charge_cache_hits: true")
    policy = parse_policy(switches, file="p.yaml", environ={"UPSTREAM": "secret"})
    assert policy.tenants["support-bot"].budget.charge_cache_hits is True


def test_dangling_references_are_errors() -> None:
    text = GOOD.replace("    models: [m1]\n    budget", "    models: [m1, m9]\n    budget").replace(
        "  m2: {}\n", "  m2: {}\n  m3: {}\n"
    )
    assert problems(text) == [
        "p.yaml:16: models.m3: model 'm3' has no backend serving it",
        "p.yaml:20: tenants.support-bot.models[1]: unknown model 'm9' (declare it under models:)",
    ]


def test_keys_must_be_hashed_or_env_references() -> None:
    found = problems(GOOD.replace(KEY, "plain-text-key"))
    assert len(found) == 1
    assert "p.yaml:18: tenants.support-bot.api_keys[0]: API keys are stored hashed" in found[0]
    found = problems(GOOD, environ={})
    assert found == [
        "p.yaml:5: backends[0].api_key: environment variable UPSTREAM is not set or empty"
    ]


def test_duplicate_keys_and_broken_yaml() -> None:
    assert problems(GOOD.replace("storage: memory\n", "storage: memory\nstorage: memory\n")) == [
        "p.yaml:2: storage: duplicate key"
    ]
    assert problems("backends: [\n")[0].startswith("p.yaml:2: invalid YAML")
    assert problems("- just\n- a list\n") == ["p.yaml:1: the policy file must be a YAML mapping"]


def test_per_model_limits_must_name_a_model_that_may_serve_the_tenant() -> None:
    text = GOOD.replace(
        "limits: {requests_per_minute: 600, queue_timeout: 2s}",
        "limits: {requests_per_minute: 600, per_model: {m2: {max_concurrent: 2}}}",
    )
    assert problems(text) == [
        "p.yaml:24: tenants.support-bot.limits.per_model.m2: no request of the tenant reaches "
        "model 'm2' (not one of its models, a model its degradation rules send requests to, nor "
        "a fallback model of either)"
    ]


def test_names_that_would_break_redis_hash_tags_are_refused() -> None:
    found = problems(GOOD.replace("support-bot:", "support{bot}:"))
    assert len(found) == 1
    assert found[0] == (
        "p.yaml:17: tenants.support{bot}: names may not contain { or }: "
        "they become Redis hash tags (tw:{name})"
    )


def test_ledger_urls_are_checked() -> None:
    assert problems(GOOD.replace("storage: memory", "storage: memory\nledger: postgres://x")) == [
        "p.yaml:2: ledger: a ledger is sqlite:///relative.db, sqlite:////absolute.db, "
        "redis://host:port/db, or redis (the storage's Redis)"
    ]
    assert problems(GOOD.replace("storage: memory", "storage: memory\nledger: redis")) == [
        "p.yaml:2: ledger: ledger: redis needs a Redis storage (redis://...)"
    ]


def test_storage_urls_are_checked() -> None:
    sentinel = "storage: redis+sentinel://10.0.0.1:26379,10.0.0.2/tokenweir/2\nledger: redis"
    policy = parse_policy(GOOD.replace("storage: memory", sentinel), environ={"UPSTREAM": "s"})
    assert policy.storage == "redis+sentinel://10.0.0.1:26379,10.0.0.2/tokenweir/2"
    assert problems(GOOD.replace("storage: memory", "storage: mysql://x")) == [
        "p.yaml:1: storage: storage is memory, redis://host:port/db, rediss://..., unix:///path, "
        "redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db], "
        "or redis+cluster://[[user]:password@]host:port[,host:port...][/0] "
        "(rediss+cluster:// with TLS)"
    ]
    assert problems(GOOD.replace("storage: memory", "storage: redis+sentinel://h:1")) == [
        "p.yaml:1: storage: a Sentinel URL names its service after the hosts: "
        "redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]"
    ]
    cluster = "storage: redis+cluster://10.0.0.1:7000,10.0.0.2:7000\nledger: redis"
    policy = parse_policy(GOOD.replace("storage: memory", cluster), environ={"UPSTREAM": "s"})
    assert policy.storage == "redis+cluster://10.0.0.1:7000,10.0.0.2:7000"
    assert problems(GOOD.replace("storage: memory", "storage: redis+cluster://h:7000/2")) == [
        "p.yaml:1: storage: a Redis Cluster has only database 0, got /2"
    ]


def test_the_embedder_is_one_model_a_backend_serves_or_the_local_one() -> None:
    with_embedder = GOOD.replace("storage: memory", "storage: memory\nembedder: {model: m2}")
    assert parse_policy(with_embedder, file="p.yaml", environ={"UPSTREAM": "s"}).embedder
    both = "embedder: {model: m2, local: all-MiniLM-L6-v2}"
    assert problems(GOOD.replace("storage: memory", f"storage: memory\n{both}")) == [
        "p.yaml:2: embedder: set exactly one of embedder.model or embedder.local"
    ]
    unserved = GOOD.replace("storage: memory", "storage: memory\nembedder: {model: m3}")
    assert problems(unserved.replace("  m2: {}", "  m2: {}\n  m3: {}")) == [
        "p.yaml:2: embedder.model: no backend serves model 'm3'",
        "p.yaml:17: models.m3: model 'm3' has no backend serving it",
    ]


def test_every_problem_is_reported_in_one_run_sorted_by_line() -> None:
    """A misspelt key does not hide an unknown model: pydantic's errors and the cross-reference
    checks are reported together, in the order of the file."""
    extra_backend = "    weight: 3\n  - name: a\n    url: http://h/v1\n    models: [m7]\n"
    text = (
        GOOD.replace("    models: [m1]\n    budget:", "    models: [m1, m9]\n    budget:")
        .replace("      history_limit: 10\n", "      histroy: 10\n")
        .replace("    weight: 3\n", extra_backend)
        .replace("storage: memory\n", "storage: memory\nledgr: x\n")
    )
    assert problems(text) == [
        "p.yaml:2: ledgr: unknown key (did you mean ledger?)",
        "p.yaml:12: backends[2].name: duplicate backend name 'a'",
        "p.yaml:14: backends[2].models[0]: unknown model 'm7' (declare it under models:)",
        "p.yaml:23: tenants.support-bot.models[1]: unknown model 'm9' (declare it under models:)",
        "p.yaml:27: tenants.support-bot.budget.histroy: unknown key",
    ]


def test_references_after_a_refused_list_item_keep_their_own_lines() -> None:
    text = GOOD.replace("    models: [m1]\n    budget:", "    models: [5, m9]\n    budget:")
    found = problems(text.replace("    weight: 3\n", "    weight: lots\n"))
    assert [line.split(": ")[0:2] for line in found] == [
        ["p.yaml:10", "backends[1].weight"],
        ["p.yaml:19", "tenants.support-bot.models[0]"],
        ["p.yaml:19", "tenants.support-bot.models[1]"],
    ]
    assert found[-1].endswith("unknown model 'm9' (declare it under models:)")


def test_missing_file_is_a_policy_error(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot read the file"):
        load_policy(tmp_path / "absent.yaml")


@pytest.mark.parametrize("name", ["default.yaml", "demo.yaml", "budgets.example.yaml"])
def test_shipped_policies_are_valid(name: str) -> None:
    policy = load_policy(DEFAULT_POLICY.with_name(name), environ={"TOKENWEIR_API_KEY": "k"})
    assert policy.tenants


def test_a_refused_storage_url_is_not_also_a_ledger_without_redis() -> None:
    """A mistyped Redis URL was two problems, the second false: "ledger: redis needs a Redis
    storage", as if the storage were memory."""
    text = GOOD.replace("storage: memory", "storage: redis+cluster://h:7000/2\nledger: redis")
    assert problems(text) == [
        "p.yaml:1: storage: a Redis Cluster has only database 0, got /2",
    ]


def test_a_price_finer_than_costs_are_counted_is_refused_not_rounded_to_nothing() -> None:
    """OpenAI's price per token (0.00000015 USD) typed as a price per million tokens loaded, and
    was kept as 0 pico-USD a token: every request cost $0, and a USD quota never refused one.
    A price of 6 decimals is the finest kept exactly; one finer is an error that says why."""
    text = GOOD.replace("input_per_1m: 0.10", "input_per_1m: 0.00000015").replace(
        "output_per_1m: 0.40", "output_per_1m: 0.0000006"
    )
    assert problems(text) == [
        "p.yaml:14: models.m1.price.input_per_1m: 0.00000015 USD per million tokens "
        "is finer than costs are counted (0.000001 USD per million tokens, a pico-USD a token); "
        "if it is a price per token, per million tokens it is 0.15",
        "p.yaml:14: models.m1.price.output_per_1m: 0.0000006 USD per million tokens "
        "is finer than costs are counted (0.000001 USD per million tokens, a pico-USD a token); "
        "if it is a price per token, per million tokens it is 0.6",
    ]
    finest = GOOD.replace("input_per_1m: 0.10", "input_per_1m: 0.000001").replace(
        "output_per_1m: 0.40", "output_per_1m: 4999.123456"
    )
    price = parse_policy(finest, file="p.yaml", environ={"UPSTREAM": "s"}).models["m1"].price
    assert (price.input_per_1m, price.output_per_1m) == (0.000001, 4999.123456)


def test_a_budget_rule_needs_a_quota_of_the_tenant() -> None:
    """budget_used_above measures the tenant's quotas: on a tenant without one the rule was
    loaded, and silently never fired."""
    text = GOOD.replace("inflight_ratio_above: 0.8", "budget_used_above: 0.8")
    assert problems(text) == [
        "p.yaml:28: tenants.support-bot.degrade[0].when.budget_used_above: the tenant has no "
        "quota to measure (budget: tokens_per_day, tokens_per_month, usd_per_day or "
        "usd_per_month), so the rule would never fire"
    ]
    with_quota = text.replace("history_limit: 10", "history_limit: 10\n      usd_per_month: 5")
    parse_policy(with_quota, file="p.yaml", environ={"UPSTREAM": "secret"})


def test_a_fallback_rule_model_or_verifier_naming_nothing_is_named_at_its_line() -> None:
    """They were refused at line 1, one at a time, hiding every other problem of the file."""
    swaps = {
        "  m2: {}\n": "  m2: {fallback_models: [m2, m8]}\n",
        "then: {max_output_tokens: 128}": "then: {model: m9}",
        "ttl: 1h}": "ttl: 1h, verifier: {backend: nowhere, model: m1}}",
        "      history_limit: 10\n": "      histroy: 10\n",
        "    url: http://127.0.0.1:8001/v1\n": "",  # a refused backend hides no fallback's problem
    }
    text = GOOD
    for old, new in swaps.items():
        text = text.replace(old, new)
    assert problems(text) == [
        "p.yaml:7: backends[1].url: required key is missing",
        "p.yaml:14: models.m2.fallback_models[0]: 'm2' is not another model here",
        "p.yaml:14: models.m2.fallback_models[1]: 'm8' is not another model here",
        "p.yaml:22: tenants.support-bot.budget.histroy: unknown key",
        "p.yaml:28: tenants.support-bot.degrade[0].then.model: unknown model 'm9' "
        "(declare it under models:)",
    ]
    # Without the refused backend, which the verifier may have meant, its name is checked too.
    fixed = text.replace(
        "    models: [m1]\n    weight: 3", "    url: http://h/v1\n    models: [m1]\n    weight: 3"
    )
    assert "p.yaml:25: tenants.support-bot.cache.verifier.backend: no backend named 'nowhere'" in (
        problems(fixed)
    )
