"""Policy files as YAML: what the reader refuses (alias bombs, endless nesting, bytes not in
UTF-8, numbers past counting, words YAML reads as booleans) and how each problem is named."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from proxy.policy import PolicyError, load_policy, parse_policy
from proxy.policy.units import hash_key
from tests.policy.test_load import GOOD, KEY, problems


def _alias_bomb(levels: int) -> str:
    """A "billion laughs": each anchor's list holds nine aliases of the one before."""
    lines = ["    models: &l0 [m1, m1, m1, m1, m1, m1, m1, m1, m1]"]
    for level in range(1, levels):
        aliases = ", ".join([f"*l{level - 1}"] * 9)
        lines.append(f"        m{level}: &l{level} [{aliases}]")
    lines.insert(1, "    limits:\n      per_model:")
    return GOOD.replace("    models: [m1]\n    budget:", "\n".join(lines) + "\n    budget:")


def test_an_alias_bomb_is_refused_at_once_in_little_memory() -> None:
    """Nine levels of nine aliases (387 million values from 12 lines) took the loader minutes
    and gigabytes; it is now an error naming where the aliases are used."""
    text = _alias_bomb(9)
    started = time.process_time()
    found = problems(text)
    assert time.process_time() - started < 20  # was: not done in 10 minutes
    assert found == [
        "p.yaml:26: tenants.support-bot.limits.per_model.m5: aliases here repeat more values "
        "than the file holds 10 times over (and more than 100,000): write them out"
    ]


def test_anchors_shared_by_many_tenants_are_fine() -> None:
    tenants = "".join(
        f"  t{i}:\n    api_keys: [{hash_key(str(i))}]\n    models: [m1]\n    degrade: *rules\n"
        for i in range(300)
    )
    text = GOOD.replace("    degrade:\n", "    degrade: &rules\n") + tenants
    policy = parse_policy(text, file="p.yaml", environ={"UPSTREAM": "secret"})
    assert policy.tenants["t299"].degrade[0].name == "shorten-under-load"


@pytest.mark.parametrize(
    "value",
    [
        "[" * 5000 + "]" * 5000,
        "{a: " * 5000 + "1" + "}" * 5000,
        "&loop [*loop]",
        "&loop {a: *loop}",
    ],
)
def test_values_nested_without_end_are_refused(value: str) -> None:
    """Deep nesting and an alias inside its own anchor were a RecursionError traceback."""
    found = problems(f"x: {value}\n" + GOOD)
    assert len(found) == 1
    assert found[0].startswith("p.yaml:1: ")
    assert "values are nested more than 32 levels deep" in found[0]


def test_a_file_not_in_utf8_names_the_line_of_its_first_bad_byte(tmp_path: Path) -> None:
    """A Latin-1 é was a UnicodeDecodeError traceback from `policy check`, and `serve` took it
    as U+FFFD, changing the system prompt without a word."""
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(
        GOOD.replace("history_limit: 10", "history_limit: 10 # café").encode(
            "latin-1", errors="replace"
        )
    )
    with pytest.raises(PolicyError) as caught:
        load_policy(latin1, environ={"UPSTREAM": "s"})
    assert [str(p) for p in caught.value.problems] == [
        f"{latin1}:23: byte 0xe9 is not UTF-8: save the file as UTF-8"
    ]
    with_bom = tmp_path / "bom.yaml"
    with_bom.write_bytes(b"\xef\xbb\xbf" + GOOD.encode())
    assert load_policy(with_bom, environ={"UPSTREAM": "s"}).tenants


def test_numbers_that_are_not_finite_or_too_large_to_count_are_refused() -> None:
    """`.inf`, `.nan` and numbers past what the gateway can count passed the check; then
    `.inf` as a price failed serve's startup with an OverflowError traceback, `.inf` or 1e300
    as a USD budget and 1e26 as max_output_tokens made every request a 500, and `.nan` turned
    timeouts and TTLs into nonsense."""
    text = (
        GOOD.replace("input_per_1m: 0.10", "input_per_1m: .inf")
        .replace("output_per_1m: 0.40", "output_per_1m: 2000000")
        .replace("max_output_tokens: 512", "max_output_tokens: 99999999999999999999999999")
        .replace("history_limit: 10", "history_limit: 10\n      usd_per_day: 1.0e300")
        .replace("queue_timeout: 2s", "queue_timeout: .nan")
        .replace("ttl: 1h", "ttl: 99999999d")
    )
    assert problems(text) == [
        "p.yaml:14: models.m1.price.input_per_1m: Input should be less than or equal to 5000",
        "p.yaml:14: models.m1.price.output_per_1m: Input should be less than or equal to 5000",
        "p.yaml:22: tenants.support-bot.budget.max_output_tokens: 1e+26 is too large: "
        "at most 9,007,199,254,740,991",
        "p.yaml:24: tenants.support-bot.budget.usd_per_day: 1e+300 is too large: "
        "at most 9,007,199,254,740,991",
        "p.yaml:25: tenants.support-bot.limits.queue_timeout: a duration is a number of "
        "seconds, 0 or more, got nan",
        "p.yaml:26: tenants.support-bot.cache.ttl: a duration is at most 36500d (100 years), "
        "got '99999999d'",
    ]


@pytest.mark.parametrize(
    ("value", "flaw"),
    [
        ("secret\n", "ends with a newline"),
        ("secret\r\n", "ends with a newline"),
        (" secret", "starts or ends with whitespace"),
        ("sec\x00ret", "holds a control character"),
    ],
)
def test_a_variable_no_header_can_carry_is_refused(value: str, flaw: str) -> None:
    found = problems(GOOD, environ={"UPSTREAM": value})
    assert len(found) == 1
    assert found[0].startswith(
        f"p.yaml:5: backends[0].api_key: environment variable UPSTREAM {flaw}, which no "
        "client or backend can send"
    )


@pytest.mark.parametrize(
    ("environ", "literal", "flaw"),
    [
        ({"UPSTREAM": "sk-\u00e4bc"}, None, "holds U+00E4 (character 4)"),
        ({}, '"sk-a\\u00a0b"', "holds U+00A0 (character 5)"),  # a pasted non-breaking space
        ({}, '"sk-\\u201cab"', "holds U+201C (character 4)"),
        ({}, '"sk-a\\tb"', "holds a control character"),
        ({}, '"sk-ab "', "starts or ends with whitespace"),
    ],
)
def test_a_backend_key_no_header_can_carry_is_refused(
    environ: dict[str, str], literal: str | None, flaw: str
) -> None:
    """A backend key past ASCII loaded, and every request to the backend (and /readyz) was
    a 500; one written in the file was not checked at all."""
    text = GOOD if literal is None else GOOD.replace("${UPSTREAM}", literal)
    found = problems(text, environ=environ)
    assert len(found) == 1
    assert found[0].startswith(f"p.yaml:5: backends[0].api_key: the key {flaw}")
    assert "sk-" not in found[0]  # the key itself is never shown


def test_a_reference_is_a_whole_value_and_storage_may_be_one() -> None:
    """`url: http://${HOST}:8000/v1` was taken as written, "${HOST}" and all (every request
    then a 502), and `storage: ${REDIS_URL}` was refused as no storage URL at all."""
    text = (
        GOOD.replace("http://127.0.0.1:8001/v1", "http://${HOST}:8001/v1")
        .replace("api_key: ${UPSTREAM}", "api_key: Bearer ${UPSTREAM}")
        .replace("storage: memory", "storage: memory\nledger: sqlite:///${DIR}/t.db")
    )
    whole = "a ${NAME} reference is the whole value (url: ${BACKEND_URL}), not a part of it"
    assert problems(text, environ={"HOST": "h", "UPSTREAM": "u", "DIR": "d"}) == [
        f"p.yaml:2: ledger: {whole}",
        f"p.yaml:6: backends[0].api_key: {whole}",
        f"p.yaml:9: backends[1].url: {whole}",
    ]
    from_env = GOOD.replace("storage: memory", "storage: ${REDIS_URL}")
    environ = {"REDIS_URL": "redis://10.0.0.5:6379/0", "UPSTREAM": "u"}
    assert parse_policy(from_env, environ=environ).storage == "redis://10.0.0.5:6379/0"
    # A key's value is used as it is, never resolved again.
    again = parse_policy(GOOD, environ={"UPSTREAM": "${OTHER}", "OTHER": "x"}).backends[0]
    assert again.api_key is not None
    assert again.api_key.get_secret_value() == "${OTHER}"


def test_a_word_yaml_reads_as_a_boolean_or_number_is_explained() -> None:
    """`mode: off` was refused with "Input should be 'off', ...", and a tenant named `yes`
    as "tenants[1]: Input should be a valid string" on the line of `tenants:`: YAML 1.1 reads
    those words unquoted as false and true, which the message now says, with the fix."""
    assert problems(GOOD.replace("mode: semantic", "mode: off")) == [
        "p.yaml:25: tenants.support-bot.cache.mode: Input should be 'off', 'exact', 'semantic' "
        "or 'always'; YAML reads off unquoted as false: write it in quotes, 'off'",
    ]
    assert problems(GOOD.replace("support-bot:", "yes:")) == [
        "p.yaml:17: tenants.yes: Input should be a valid string; YAML reads yes unquoted as "
        "true: write it in quotes, 'yes'",
    ]
    quoted = GOOD.replace("mode: semantic", "mode: 'off'").replace("support-bot:", "'yes':")
    assert parse_policy(quoted, environ={"UPSTREAM": "s"}).tenants["yes"].cache.mode == "off"


def test_names_with_a_newline_or_control_character_are_refused() -> None:
    """A degrade rule named "shorten\\nx-evil: 1" loaded; then every request it degraded lost
    its connection without an answer (uvicorn: "Invalid HTTP header value" for
    x-tokenweir-degraded), and a tenant's newline split the log lines naming it."""
    text = GOOD.replace("name: shorten-under-load", 'name: "shorten\\nx-evil: 1"').replace(
        "support-bot:", '"support\\tbot":'
    )
    control = "names may not hold a newline or another control character"
    found = problems(text)
    assert [line.split(": ")[0:2] for line in found] == [
        ["p.yaml:17", "tenants.support\tbot"],
        ["p.yaml:27", "tenants.support\tbot.degrade[0].name"],
    ]
    assert all(control in line for line in found)
    unicode = GOOD.replace("name: shorten-under-load", "name: 負荷時に短く").replace(
        "support-bot:", '"support bot: 客服":'
    )
    assert parse_policy(unicode, environ={"UPSTREAM": "s"}).tenants["support bot: 客服"]


def test_a_timeout_of_zero_is_refused_not_a_504_for_every_request() -> None:
    """`read_timeout: 0` or `connect_timeout: 0` (read as "none" in many tools) loaded, then
    every request was a 504: to httpx a timeout of 0 is "at once". An embedder's timeout of 0
    missed every semantic lookup the same way."""
    text = GOOD.replace("storage: memory", "storage: memory\nembedder: {model: m2, timeout: 0}")
    text += "upstream: {connect_timeout: 0, read_timeout: 0s}\n"
    assert problems(text) == [
        "p.yaml:2: embedder.timeout: Input should be greater than 0",
        "p.yaml:31: upstream.connect_timeout: Input should be greater than 0",
        "p.yaml:31: upstream.read_timeout: Input should be greater than 0",
    ]


def test_shapes_are_named_in_yaml_terms_and_an_empty_file_says_so() -> None:
    """`api_keys: sha256:...` (one key, no brackets) was "Input should be a valid tuple",
    `budget: 5` "a valid dictionary or instance of Budget", `backends: []` "Tuple should have
    at least 1 item after validation, not 0", and an empty file "must be a YAML mapping"."""
    text = (
        GOOD.replace(f"api_keys: [{KEY}]", f"api_keys: {KEY}")
        .replace("    budget:\n", "    budget: 5\n    budgt:\n")
        .replace("storage: memory", "storage: memory\nadmin_keys: []")
    )
    a_list = "expected a list: [a, b], or one '- item' line each (a single item too: [a])"
    assert problems(text) == [
        f"p.yaml:19: tenants.support-bot.api_keys: {a_list}",
        "p.yaml:21: tenants.support-bot.budget: expected a mapping: {key: value}, or one "
        "'key: value' line each",
        "p.yaml:22: tenants.support-bot.budgt: unknown key (did you mean budget?)",
    ]
    assert problems(GOOD.replace("    models: [m1]\n    budget", "    models: []\n    budget")) == [
        "p.yaml:19: tenants.support-bot.models: expected at least 1 item, got 0"
    ]
    for empty in ["", "# nothing yet\n", "---\n"]:
        assert problems(empty) == [
            "p.yaml:1: the policy file is empty: it needs backends:, models: and tenants:"
        ]
