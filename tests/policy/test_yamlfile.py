"""A policy file's YAML: what the reader refuses is a line-numbered problem, never a traceback,
from `policy check`, `serve` and a reload alike."""

from __future__ import annotations

import subprocess
import sys
import unicodedata
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import httpx
import pytest
import yaml

from proxy.app import DEFAULT_POLICY, create_app
from proxy.policy import PolicyError, load_policy, parse_policy
from proxy.policy.units import hash_key
from proxy.policy.yamlfile import HAS_LIBYAML, read_yaml
from proxy.tools.mock import backend as mockbackend
from tests.conftest import BACKEND_KEY, BETA_KEY, policy_text
from tests.policy.test_load import GOOD, problems
from tests.policy.test_load_yaml import _alias_bomb
from tests.servers import free_port, serve
from tests.test_cli import tokenweir
from tests.test_reload import ADMIN, CHAT, STAY_KEY
from tests.test_reload import policy_text as reload_policy_text


def _problems(path: Path) -> list[str]:
    with pytest.raises(PolicyError) as caught:
        load_policy(path, environ={"BACKEND_KEY": BACKEND_KEY, "BETA_KEY": BETA_KEY})
    return [str(p) for p in caught.value.problems]


def test_a_control_character_or_a_value_yaml_cannot_build_is_a_line_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stray BEL pasted into a comment, a date with month 13 or an integer of 5,000 digits
    was a ReaderError or ValueError traceback from `policy check` and `serve`."""
    monkeypatch.setenv("BACKEND_KEY", BACKEND_KEY)
    monkeypatch.setenv("BETA_KEY", BETA_KEY)
    good = policy_text("http://127.0.0.1:9")
    line = good.splitlines().index("  beta:") + 1
    cases = {
        "bell.yaml": (
            good.replace("  beta:", "  # the \x07beta team\n  beta:"),
            f":{line}: character U+0007 is not allowed in YAML, even in a comment",
        ),
        "date.yaml": (
            good.replace("  beta:", "  x: 2026-13-01\n  beta:"),
            f":{line}: invalid YAML: 2026-13-01 is not a valid timestamp (month must be in 1..12)",
        ),
        "digits.yaml": (
            good.replace("  beta:", f"  x: 1{'0' * 5000}\n  beta:"),
            f":{line}: invalid YAML: {'1' + '0' * 39} is not a valid int (5001 digits)",
        ),
    }
    for name, (text, message) in cases.items():
        config = tmp_path / name
        config.write_text(text)
        assert _problems(config)[0].removeprefix(str(config)).startswith(message)
        for command in [("policy", "check"), ("serve", "--port", str(free_port()), "--config")]:
            done = tokenweir(*command, str(config))
            assert done.returncode == 1, done.stderr[-2000:]
            assert f"{config}{message}" in done.stderr
            assert "Traceback" not in done.stderr


@pytest.mark.anyio
async def test_a_reload_of_a_file_with_a_control_character_is_refused_as_a_400(
    tmp_path: Path,
) -> None:
    """POST /admin/reload dropped the connection without an answer (a ReaderError escaped the
    route); it is the reload's 400, naming the line, and the old policy keeps serving."""
    with serve(mockbackend.create_app(ttft_ms=0)) as backend:
        config = tmp_path / "policy.yaml"
        config.write_text(reload_policy_text(backend))
        with serve(create_app(config=config)) as url:
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                config.write_text(reload_policy_text(backend, newcomer=True) + "# \x1b[31m\n")
                refused = await http.post("/admin/reload", headers=ADMIN)
                bearer = {"authorization": f"Bearer {STAY_KEY}"}
                still = await http.post("/v1/chat/completions", json=CHAT, headers=bearer)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "invalid_policy"
    assert f"{config}:13: character U+001B is not allowed" in refused.json()["error"]["message"]
    assert still.status_code == 200


def _tenants(count: int) -> str:
    """A policy of `count` tenants, each with a budget, limits and a degrade rule."""
    tenants = "".join(
        f"  tenant-{i}:\n    api_keys: [{hash_key(str(i))}]\n    models: [m1]\n"
        f"    budget: {{max_output_tokens: 512, temperature: 0.3, tokens_per_day: 2000000}}\n"
        f"    limits: {{requests_per_minute: 600, max_concurrent: 16}}\n"
        f"    degrade:\n      - name: shorter\n        when: {{inflight_ratio_above: 0.8}}\n"
        f"        then: {{max_output_tokens: 128}}\n"
        for i in range(count)
    )
    return GOOD + tenants


def _read(text: str, pure: bool) -> object:
    """The document, its lines and words; or the problems (a syntax error by its line: its
    wording is each reader's own)."""
    try:
        return read_yaml(text, "p.yaml", pure=pure)
    except PolicyError as exc:
        return [str(p).split(" invalid YAML: ")[0] for p in exc.problems]


@pytest.mark.skipif(not yaml.__with_libyaml__, reason="this PyYAML was built without libyaml")
def test_libyaml_reads_a_large_file_in_c_with_the_same_lines() -> None:
    """A 20,000-tenant file took PyYAML's Python reader 16-40 s (each reload and each start);
    libyaml reads it in about a third of the time (measured: 0.25-0.35 of the CPU), every key's
    line and word the same. Held by what runs, not by a timing: the file is scanned and parsed
    in C, PyYAML's Python scanner and parser never called (a ratio of CPU times failed once on a
    loaded machine)."""
    assert HAS_LIBYAML
    text = _tenants(1500)
    ran = {
        pure: _python_reader_calls(lambda pure=pure: _read(text, pure)) for pure in (True, False)
    }
    assert ran[True][0] == ran[False][0]  # the same document, lines and words
    assert ran[True][1] > 10_000  # the Python reader: calls into yaml/scanner.py, parser.py
    assert ran[False][1] == 0


def _python_reader_calls(read: Callable[[], object]) -> tuple[object, int]:
    """What `read` returns, and how many Python calls it made into PyYAML's own scanner and
    parser modules (libyaml does their work in C)."""
    modules = {str(Path(yaml.__file__).parent / name) for name in ("scanner.py", "parser.py")}
    calls = 0

    def count(frame: FrameType, event: str, _: object) -> None:
        nonlocal calls
        if event == "call" and frame.f_code.co_filename in modules:
            calls += 1

    sys.setprofile(count)
    try:
        document = read()
    finally:
        sys.setprofile(None)
    return document, calls


@pytest.mark.parametrize(
    "text",
    [
        "x: " + "[" * 5000 + "]" * 5000 + "\n" + GOOD,
        "x: " + "{a: " * 1200 + "1" + "}" * 1200 + "\n" + GOOD,
        "x: &loop [*loop]\n" + GOOD,
        _alias_bomb(9),
        GOOD.replace("mode: semantic", "mode: off").replace("support-bot:", "yes:"),
        GOOD.replace("history_limit: 10", "history_limit: 10  # \x07"),
        GOOD.replace("history_limit: 10", "history_limit: 2026-02-30"),
        GOOD.replace("history_limit: 10", "history_limit: [10"),
        GOOD.replace("\n", "\r\n"),
        *(p.read_text() for p in sorted(DEFAULT_POLICY.parent.glob("*.yaml"))),
    ],
    ids=lambda text: text[:12],
)
def test_libyaml_and_the_python_reader_keep_the_same_guards(text: str) -> None:
    """Nesting, aliases, words YAML reads as booleans, control characters: libyaml (when
    PyYAML has it) and the Python reader (when not) refuse or read a file alike."""
    pure = _read(text, pure=True)
    assert _read(text, pure=False) == pure
    assert isinstance(pure, list) or pure[1]  # refused with problems, or read with its lines


def test_keys_yaml_reads_as_one_or_that_look_alike_are_duplicates() -> None:
    """Tenants `yes:` and `on:` (both true to YAML) were one key: the error named only the
    second and the first vanished; `1` and `1.0` the same. A tenant written `café` twice, once
    precomposed and once with a combining accent, loaded as two tenants no report, dashboard
    or log line tells apart. Each is now a duplicate key naming both lines."""
    tenant = "    api_keys: [{key}]\n    models: [m1]\n"

    def two(first: str, second: str) -> str:
        extra = f"  {first}:\n{tenant.format(key=hash_key('a'))}"
        return GOOD + extra + f"  {second}:\n{tenant.format(key=hash_key('b'))}"

    line = GOOD.count("\n") + 4
    nfc, nfd = unicodedata.normalize("NFC", "café"), unicodedata.normalize("NFD", "café")
    assert problems(two("yes", "on")) == [
        f"p.yaml:{line}: tenants.on: duplicate key: YAML reads yes (line {line - 3}) and on "
        "unquoted as the same key: write them in quotes"
    ]
    assert problems(two("1", "1.0"))[0].startswith(f"p.yaml:{line}: tenants.1.0: duplicate key")
    assert problems(two(nfc, nfd)) == [
        f"p.yaml:{line}: tenants.{nfd}: duplicate key: the same name as '{nfc}' (line "
        f"{line - 3}) but for how its accents are encoded (Unicode NFC): the two would look "
        "alike wherever they are shown"
    ]
    policy = parse_policy(two("'yes'", "'on'"), environ={"UPSTREAM": "s"})
    assert {"yes", "on"} <= set(policy.tenants)
    assert {"Café", "café"} <= set(
        parse_policy(two("Café", nfc), environ={"UPSTREAM": "s"}).tenants
    )


_PROMPT = "system_prompt: 你是智能客服助手，请用简洁中文回答用户问题。"
_ESCAPED = GOOD.replace(_PROMPT, 'system_prompt: "hi \\ud83d\\ude00"')


@pytest.mark.parametrize("pure", [True, False])
def test_half_a_utf16_pair_is_refused_by_either_reader(pure: bool) -> None:
    """`system_prompt: "hi \\ud83d\\ude00"` (an emoji escaped as JSON does it): PyYAML's
    Python reader kept two lone surrogates, and every request of the tenant was a 500 (the
    prompt cannot be encoded). libyaml refuses it; now the Python reader does too, and a key
    so escaped is named by its mapping (the key itself cannot be printed)."""
    line = GOOD.splitlines().index(f"      {_PROMPT}") + 1
    shown = (
        f"p.yaml:{line}: tenants.support-bot.budget.system_prompt:" if pure else f"p.yaml:{line}:"
    )
    assert _read(_ESCAPED, pure=pure) == [shown]
    key = GOOD.replace("  support-bot:", '  "support-bot \\udc00":')
    line = GOOD.splitlines().index("  support-bot:") + 1
    assert _read(key, pure=pure) == [f"p.yaml:{line}: tenants:" if pure else f"p.yaml:{line}:"]


def test_policy_check_refuses_half_a_utf16_pair(tmp_path: Path) -> None:
    """`policy check` said ok to the file whose tenant then got a 500 for every request."""
    config = tmp_path / "policy.yaml"
    config.write_text(_ESCAPED)
    done = tokenweir("policy", "check", "--skip-tokenizers", str(config))
    assert done.returncode == 1, done.stdout
    assert f"{config}:{GOOD.splitlines().index(f'      {_PROMPT}') + 1}: " in done.stderr
    assert "Traceback" not in done.stderr


def test_a_word_yaml_reads_as_other_than_text_where_a_key_is_fixed_is_explained() -> None:
    """`on:` among a tenant's `cache:` keys was "tenants.support-bot.cache[1]: Keys should be
    strings": the key shown as an index, the word YAML read as true unexplained."""
    text = GOOD.replace("cache: {mode: semantic,", "cache: {on: true, mode: semantic,")
    line = GOOD.splitlines().index("    cache: {mode: semantic, similarity: 0.92, ttl: 1h}") + 1
    assert problems(text) == [
        f"p.yaml:{line}: tenants.support-bot.cache.on: a key must be text; YAML reads on unquoted "
        "as true: write it in quotes, 'on'"
    ]


_DEEP_IN_A_THREAD = """
import sys, threading
from proxy.policy.yamlfile import read_yaml
from proxy.policy.problems import PolicyError
threading.stack_size(256 * 1024)
def read():
    for text in ["x: " + "[" * 999 + "]" * 999, "".join(" " * i + "k:\\n" for i in range(999))]:
        try:
            read_yaml(text + "v\\n", "p.yaml")
        except PolicyError as exc:
            print(exc)
thread = threading.Thread(target=read)
thread.start()
thread.join()
"""


def test_libyaml_reads_a_deeply_nested_file_in_a_small_thread_stack() -> None:
    """A reload reads the file in a worker thread: PyYAML's C code built 999 nested lists by
    recursing 999 times, and with a 256 KiB thread stack (musl's is 128 KiB) the gateway died
    of a segmentation fault. The nesting is now refused before libyaml builds anything."""
    done = subprocess.run(
        [sys.executable, "-c", _DEEP_IN_A_THREAD],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    deep = "values are nested more than 32 levels deep (or an alias is inside its own anchor)"
    assert done.stdout.splitlines() == [f"p.yaml:1: {deep}", f"p.yaml:65: {deep}"]


def test_the_escape_offered_for_a_character_past_latin1_is_one_yaml_reads() -> None:
    """U+FFFE was offered as `\\xfffe`, which YAML reads as ÿ and the text "fe"."""
    text = GOOD.replace("history_limit: 10", "history_limit: 10  # \ufffe")
    line = GOOD.splitlines().index("      history_limit: 10") + 1
    assert problems(text) == [
        f"p.yaml:{line}: character U+FFFE is not allowed in YAML, even in a comment: remove it, "
        "or write it as \\ufffe inside double quotes"
    ]


@pytest.mark.parametrize("pure", [True, False])
@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x85"])
def test_lines_are_counted_as_an_editor_shows_them(separator: str, pure: bool) -> None:
    """A system prompt pasted with a Unicode line separator (U+2028, from a web page or a JS
    string) or NEL: YAML 1.1 counts it as a line end, an editor does not, and every problem
    after it named the line below the one meant."""
    prompt = f'system_prompt: "你好{separator}世界"'
    text = GOOD.replace(_PROMPT, prompt).replace("history_limit:", "history_limt:")
    line = text.split("\n").index("      history_limt: 10") + 1
    _, lines, _ = read_yaml(text, "p.yaml", pure=pure)
    assert lines[("tenants", "support-bot", "budget", "history_limt")] == line
    broken = text.replace("history_limt: 10", "history_limt: [10")
    assert _read(broken, pure=pure) == [f"p.yaml:{line + 1}:"]
    assert problems(text) == [
        f"p.yaml:{line}: tenants.support-bot.budget.history_limt: unknown key (did you mean "
        "history_limit?)"
    ]
