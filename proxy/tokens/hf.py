"""Hugging Face tokenizers: a local tokenizer.json (its directory may hold tokenizer_config.json
with a `chat_template`, or chat_template.jinja), or `hf:ORG/NAME[@REVISION]` from the Hub.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import tokenizers

from proxy.tokens.base import ChatRenderer, CountText, TokenCounter, TokenizerError
from proxy.tokens.builtin_templates import builtin_template
from proxy.tokens.chat import TemplatedCounter
from proxy.tokens.hf_template import HFTemplate
from proxy.tokens.openai_chat import GPT4_RULE, RuleCounter

__all__ = ["Fetch", "hub_fetch", "load_hub", "load_local"]

# Downloads one file of a Hub repository: (repo, filename, revision) -> local path, or None
# when the repository has no such file.
Fetch = Callable[[str, str, str | None], Path | None]


def load_local(path: Path, template: str | None, *, name: str | None = None) -> TokenCounter:
    """A tokenizer.json (or a directory holding one) and the chat template beside it."""
    file = path / "tokenizer.json" if path.is_dir() else path
    config_file, jinja_file = (
        file.parent / "tokenizer_config.json",
        file.parent / "chat_template.jinja",
    )
    return _build(
        name or f"hf:{file}",
        file,
        config_file if config_file.is_file() else None,
        jinja_file if jinja_file.is_file() else None,
        template,
    )


def load_hub(repo: str, template: str | None, fetch: Fetch | None = None) -> TokenCounter:
    """`hf:ORG/NAME[@REVISION]`: the Hub's cache, else a download (HF_TOKEN for gated models)."""
    fetch = fetch or hub_fetch
    repo_id, _, revision = repo.partition("@")
    file = fetch(repo_id, "tokenizer.json", revision or None)
    if file is None:
        raise TokenizerError(
            f"{repo_id} has no tokenizer.json on the Hugging Face Hub (or, offline, in its cache)"
        )
    config = fetch(repo_id, "tokenizer_config.json", revision or None)
    jinja_file = fetch(repo_id, "chat_template.jinja", revision or None)
    return _build(f"hf:{repo}", file, config, jinja_file, template)


def hub_fetch(repo_id: str, filename: str, revision: str | None) -> Path | None:
    import huggingface_hub  # a dependency of tokenizers, needed only here
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(str(huggingface_hub.hf_hub_download(repo_id, filename, revision=revision)))
    except EntryNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"cannot fetch {filename} of {repo_id}: {exc}") from exc


def _build(
    name: str, file: Path, config_file: Path | None, jinja_file: Path | None, template: str | None
) -> TokenCounter:
    tokenizer = _read_tokenizer(file)
    config = _read_config(config_file) if config_file else {}
    encode = _encoder(tokenizer)
    added = len(tokenizer.encode_batch_fast([""], add_special_tokens=True)[0])
    chosen = _chat_format(tokenizer, config, jinja_file, template)
    if chosen is None:
        # No template and no known family: OpenAI's per-message rule over this vocabulary.
        return RuleCounter(name, encode, GPT4_RULE, chat_format="generic", added_per_text=added)
    render, chat_format = chosen
    return TemplatedCounter(name, encode, render, chat_format=chat_format, added_per_text=added)


def _chat_format(
    tokenizer: tokenizers.Tokenizer,
    config: Mapping[str, Any],
    jinja_file: Path | None,
    template: str | None,
) -> tuple[ChatRenderer, str] | None:
    """The renderer and its origin: a named built-in, the model's own template (the
    chat_template.jinja file first, as transformers reads it), or the family's built-in.
    """
    if template is not None:
        return builtin_template(template), f"builtin:{template}"
    if jinja_file is not None:
        return _config_template(_read_text(jinja_file), config), "chat_template.jinja"
    if config.get("chat_template"):
        return _config_template(config["chat_template"], config), "tokenizer_config.json"
    family = _family(tokenizer)
    return None if family is None else (builtin_template(family), f"builtin:{family}")


def _read_tokenizer(file: Path) -> tokenizers.Tokenizer:
    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(file))
    except Exception as exc:  # the Rust extension raises bare Exception
        raise TokenizerError(f"cannot load {file} as a Hugging Face tokenizer: {exc}") from None
    # A tokenizer.json may carry training-time truncation or padding; a count must see it all.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def _read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"cannot read {file}: {exc}") from exc


def _read_config(file: Path) -> dict[str, Any]:
    try:
        config = json.loads(_read_text(file))
    except ValueError as exc:
        raise TokenizerError(f"{file} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise TokenizerError(f"{file} is not a JSON object")
    return config


def _config_template(source: object, config: Mapping[str, Any]) -> ChatRenderer:
    """The template, given as a string or as a list of named templates ("default", "tool_use")."""
    if isinstance(source, list):
        named = {
            item.get("name"): item.get("template") for item in source if isinstance(item, dict)
        }
        default, tool_use = named.get("default"), named.get("tool_use")
        if not isinstance(default, str):
            raise TokenizerError("chat_template is a list without a 'default' template")
        plain = HFTemplate(default, _special_tokens(config))
        if not isinstance(tool_use, str):
            return plain
        with_tools = HFTemplate(tool_use, _special_tokens(config))
        return lambda messages, tools: (with_tools if tools else plain)(messages, tools)
    if not isinstance(source, str):
        raise TokenizerError("chat_template is neither a string nor a list of named templates")
    return HFTemplate(source, _special_tokens(config))


def _special_tokens(config: Mapping[str, Any]) -> dict[str, object]:
    """bos_token, eos_token... as strings: the config writes them as text or as AddedToken."""
    tokens: dict[str, object] = {}
    for key, value in config.items():
        if not key.endswith("_token"):
            continue
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[key] = value
    return tokens


def _family(tokenizer: tokenizers.Tokenizer) -> str | None:
    """The built-in chat format of a tokenizer.json without a template, from its special tokens."""
    if tokenizer.token_to_id("<|start_header_id|>") == 128006:
        return "llama3.1"
    if tokenizer.token_to_id("<|im_start|>") == 151644:
        return "qwen2.5"
    if tokenizer.token_to_id("<|im_start|>") is not None:
        return "chatml"
    return None


def _encoder(tokenizer: tokenizers.Tokenizer) -> CountText:
    # The batch call releases the GIL while it encodes, so a long count in a worker thread
    # does not stall the event loop; `encode` holds it throughout.
    return lambda text: len(tokenizer.encode_batch_fast([text], add_special_tokens=False)[0])
