"""Hugging Face tokenizers: a model's own chat template rendered as transformers renders it."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import pytest

from proxy.tokens import ChatTemplateError, TokenizerError, load_counter
from proxy.tokens.builtin_templates import llama3
from proxy.tokens.chat import TemplatedCounter, normalise_messages
from proxy.tokens.hf import load_hub
from tests.shared import tokenizer_file

HELLO = [{"role": "user", "content": "你好"}]
CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "  Be brief.  "},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": [{"type": "text", "text": "And 3 + 3?"}]},
]
# Llama 3's header format, written the way Hugging Face templates usually are: whitespace
# control everywhere, indented block tags, '\n' escapes in string literals.
LLAMA3_TEMPLATE = """\
{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('Unknown role: ' + message['role']) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""


def model_dir(
    tmp_path: Path, config: dict[str, Any] | None, jinja: str | None = None, *, llama: bool = False
) -> Path:
    """A model directory: a shared tokenizer.json (small MiniLM unless `llama`) plus the given
    config and template.
    """
    source = "llama-3/tokenizer.json" if llama else "all-MiniLM-L6-v2/tokenizer.json"
    (tmp_path / "tokenizer.json").symlink_to(tokenizer_file(source))
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    return tmp_path


def templated(path: Path) -> TemplatedCounter:
    counter = load_counter(str(path), model="m")
    assert isinstance(counter, TemplatedCounter)
    return counter


def render(counter: TemplatedCounter, messages: Any, tools: Any = None) -> str:
    return counter.render(normalise_messages(messages)[0], tools)


def test_config_template_renders_and_counts_like_the_builtin(tmp_path: Path) -> None:
    config = {"bos_token": "<|begin_of_text|>", "chat_template": LLAMA3_TEMPLATE}
    counter = templated(model_dir(tmp_path, config, llama=True))
    builtin = load_counter(f"{tokenizer_file('llama-3/tokenizer.json')}#llama3", model="m")
    assert counter.chat_format == "tokenizer_config.json"
    assert render(counter, CHAT) == llama3(normalise_messages(CHAT)[0], None)
    assert counter.count_chat(CHAT) == builtin.count_chat(CHAT)
    # <|begin_of_text|>, 3 header tokens per turn and <|eot_id|>: one token each.
    assert counter.count_chat(HELLO) == 12


def test_special_tokens_written_as_added_tokens(tmp_path: Path) -> None:
    bos = {"__type": "AddedToken", "content": "<|begin_of_text|>", "lstrip": False}
    counter = templated(model_dir(tmp_path, {"bos_token": bos, "chat_template": "{{ bos_token }}"}))
    assert render(counter, HELLO) == "<|begin_of_text|>"


def test_raise_exception_becomes_a_chat_template_error(tmp_path: Path) -> None:
    counter = templated(model_dir(tmp_path, {"bos_token": "", "chat_template": LLAMA3_TEMPLATE}))
    with pytest.raises(ChatTemplateError, match="Unknown role: tool"):
        counter.count_chat([*HELLO, {"role": "tool", "content": "x"}])


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        # trim_blocks and lstrip_blocks, as transformers sets them
        ("  {% if true %}\nA\n  {% endif %}\nB", "A\nB"),
        # loop controls and the {% generation %} tag
        (
            "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
            "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
            "你好",
        ),
        # tojson keeps non-ASCII and HTML characters, and takes indent
        ("{{ tools[0] | tojson }}", '{"d": "Météo <b> & \'x\'"}'),
        ("{{ tools[0] | tojson(indent=1) }}", '{\n "d": "Météo <b> & \'x\'"\n}'),
        ("{{ strftime_now('%Y') }}", str(datetime.datetime.now().year)),
    ],
)
def test_transformers_environment(tmp_path: Path, template: str, expected: str) -> None:
    counter = templated(model_dir(tmp_path, {"chat_template": template}))
    assert render(counter, [*HELLO, *HELLO], [{"d": "Météo <b> & 'x'"}]) == expected


def test_named_templates_pick_tool_use_when_tools_are_given(tmp_path: Path) -> None:
    templates = [
        {"name": "default", "template": "plain"},
        {"name": "tool_use", "template": "tools: {{ tools | length }}"},
    ]
    counter = templated(model_dir(tmp_path, {"chat_template": templates}))
    assert render(counter, HELLO) == "plain"
    assert render(counter, HELLO, [{"type": "function"}]) == "tools: 1"


def test_chat_template_jinja_file_wins_over_the_config(tmp_path: Path) -> None:
    counter = templated(model_dir(tmp_path, {"chat_template": "config"}, jinja="file"))
    assert counter.chat_format == "chat_template.jinja"
    assert render(counter, HELLO) == "file"


def test_without_a_template_the_family_is_recognised(tmp_path: Path) -> None:
    counter = templated(model_dir(tmp_path, {"bos_token": "<|begin_of_text|>"}, llama=True))
    assert counter.chat_format == "builtin:llama3.1"


def test_a_template_syntax_error_names_its_line(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="chat template line 2"):
        load_counter(str(model_dir(tmp_path, {"chat_template": "ok\n{% if %}"})), model="m")


def test_a_tokenizer_without_chat_format_uses_the_generic_rule() -> None:
    counter = load_counter(str(tokenizer_file("all-MiniLM-L6-v2/tokenizer.json")), model="mini")
    assert getattr(counter, "chat_format", None) == "generic"
    # Its tokenizer.json pads and truncates to 128 for training; a count must not.
    long_text = "word " * 300
    assert counter.count_text(long_text) == 300
    assert counter.count_prompt(long_text) == 302  # [CLS] and [SEP]
    assert counter.count_chat(HELLO) > counter.count_text("你好")


def test_hub_models_are_fetched_once_through_the_seam() -> None:
    files = {
        "tokenizer.json": tokenizer_file("llama-3/tokenizer.json"),
        "tokenizer_config.json": tokenizer_file("llama-3/tokenizer_config.json"),
    }
    fetched: list[tuple[str, str, str | None]] = []

    def fetch(repo: str, filename: str, revision: str | None) -> Path | None:
        fetched.append((repo, filename, revision))
        return files.get(filename)

    counter = load_hub("meta-llama/Llama-3.2-1B-Instruct@main", None, fetch)
    assert counter.name == "hf:meta-llama/Llama-3.2-1B-Instruct@main"
    assert counter.count_text("hello world") == 2
    assert ("meta-llama/Llama-3.2-1B-Instruct", "tokenizer.json", "main") in fetched
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json"):
        load_hub("org/none", None, lambda repo, filename, revision: None)


def test_a_broken_tokenizer_json_is_refused(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"model": 1}')
    with pytest.raises(TokenizerError, match=r"cannot load .* as a Hugging Face tokenizer"):
        load_counter(str(tmp_path / "tokenizer.json"), model="m")
