"""Bench workloads: the optional tokenizer, synthetic or file prompts, pre-encoded request bodies.

Without a tokenizer a synthetic prompt is sized at one word per token (see `WORDS`), an estimate.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson

from proxy.tools.bench.config import BenchConfig, BenchError

__all__ = [
    "WORDS",
    "Tokenizer",
    "Workload",
    "build_workload",
    "load_tokenizer",
    "read_prompt_file",
    "synthetic_prompts",
    "tiktoken_tokenizer",
]

Messages = list[dict[str, Any]]

# Enough distinct prompts that a run rarely sends one twice (a --duration run may cycle).
_MAX_SYNTHETIC = 4096
_INSTRUCTION = "Write a long story that uses these words in this order"
# Common English words that the usual BPE vocabularies (cl100k, o200k, Llama, Mistral) hold as
# one token each when preceded by a space: the no-tokenizer rule "one word per token" rests on it.
WORDS: tuple[str, ...] = tuple(
    """the and for that with this from they have what when your will would there their about
    which more some time them other than then into could just only over also after first well
    work even want because these give most people year good make know take think come look
    back find where thing many through down long little still life world hand part place case
    point group number great again house water room mother area money story night fact month
    right study book word business issue side kind head service friend father power hour game
    line city community name president team minute idea body information school face others
    level office door health person history party result change morning reason research girl
    guy moment air teacher force education market light river stone garden green small
    large open early young important public bad same able black white red blue""".split()
)


@dataclass(frozen=True, slots=True)
class Tokenizer:
    """Encode/decode text with a named tokenizer (tiktoken or Hugging Face tokenizers)."""

    name: str
    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]

    def count(self, text: str) -> int:
        return len(self.encode(text))


@dataclass(frozen=True, slots=True)
class Workload:
    """Request bodies cycled through by every level, with what is known of their size."""

    bodies: tuple[bytes, ...]
    tokenizer: Tokenizer | None
    prompt_note: str


def _import_optional(module: str, install: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise BenchError(f"--tokenizer needs the {module} package: pip install {install}") from None


def tiktoken_tokenizer(encoding: Any) -> Tokenizer:
    """Wrap a `tiktoken.Encoding`; special-token text in prompts counts as ordinary text."""
    return Tokenizer(
        name=f"tiktoken:{encoding.name}",
        encode=lambda text: list(encoding.encode(text, disallowed_special=())),
        decode=lambda ids: str(encoding.decode(list(ids))),
    )


def load_tokenizer(spec: str) -> Tokenizer:
    """'tiktoken:o200k_base' or a Hugging Face tokenizer.json path (optionally 'hf:PATH')."""
    if spec.startswith("tiktoken:"):
        tiktoken = _import_optional("tiktoken", "tiktoken")
        name = spec.removeprefix("tiktoken:")
        try:
            return tiktoken_tokenizer(tiktoken.get_encoding(name))
        except (ValueError, OSError) as exc:
            raise BenchError(
                f"cannot load tiktoken encoding {name!r}: {str(exc)[:160]} (tiktoken downloads an"
                " encoding on first use into TIKTOKEN_CACHE_DIR; offline, give a tokenizer.json)"
            ) from None
    path = Path(spec.removeprefix("hf:"))
    if not path.is_file():
        raise BenchError(f"--tokenizer {spec!r} is neither tiktoken:NAME nor a tokenizer.json file")
    tokenizers = _import_optional("tokenizers", "tokenizers")
    try:
        hf = tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust extension raises bare Exception on a bad file
        raise BenchError(f"cannot load tokenizer {path}: {exc}") from None
    return Tokenizer(
        name=f"hf:{path.name}",
        encode=lambda text: list(hf.encode(text, add_special_tokens=False).ids),
        decode=lambda ids: str(hf.decode(list(ids))),
    )


def synthetic_prompts(
    count: int, input_tokens: int, tokenizer: Tokenizer | None, *, seed: int = 0
) -> list[str]:
    """`count` distinct prompts of `input_tokens` tokens: exact with a tokenizer, else estimated.

    Distinct random words keep a server's prefix cache from making later requests cheaper.
    """
    prompts: list[str] = []
    for index in range(count):
        rng = random.Random(seed * 1_000_003 + index)  # noqa: S311 (reproducible filler text)
        if tokenizer is None:
            words = rng.choices(WORDS, k=max(0, input_tokens - len(_INSTRUCTION.split())))
            prompts.append(" ".join([_INSTRUCTION, *words]))
        else:
            prompts.append(_exact_prompt(tokenizer, rng, input_tokens))
    return prompts


def _exact_prompt(tokenizer: Tokenizer, rng: random.Random, input_tokens: int) -> str:
    text = _INSTRUCTION
    ids = tokenizer.encode(text)
    while len(ids) < input_tokens:
        text += " " + " ".join(rng.choices(WORDS, k=input_tokens - len(ids) + 8))
        ids = tokenizer.encode(text)
    ids = ids[:input_tokens]
    # Decoding a cut token list can re-encode to a different length; trim until it does not.
    for _ in range(16):
        text = tokenizer.decode(ids)
        surplus = tokenizer.count(text) - input_tokens
        if surplus <= 0:
            break
        ids = ids[: len(ids) - surplus]
    return text


def read_prompt_file(path: str) -> list[Messages]:
    """One prompt per line: plain text, or JSONL objects with "prompt" or "messages"."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise BenchError(f"cannot read --prompt-file: {exc}") from None
    except UnicodeDecodeError as exc:
        raise BenchError(
            f"--prompt-file {path}: byte {exc.object[exc.start]:#04x} at offset {exc.start} "
            "is not UTF-8: save the file as UTF-8"
        ) from None
    prompts = [
        _messages_of(line, path, number)
        for number, line in enumerate(lines, start=1)
        if line.strip()
    ]
    if not prompts:
        raise BenchError(f"--prompt-file {path} has no prompts")
    return prompts


def _messages_of(line: str, path: str, number: int) -> Messages:
    if not line.lstrip().startswith("{"):
        return [{"role": "user", "content": line}]
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise BenchError(f"{path}:{number}: invalid JSON: {exc}") from None
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return [{"role": "user", "content": record["prompt"]}]
    if isinstance(record, dict) and isinstance(record.get("messages"), list):
        return list(record["messages"])
    raise BenchError(f"{path}:{number}: a JSON line needs a string 'prompt' or a 'messages' list")


def build_workload(config: BenchConfig, tokenizer: Tokenizer | None) -> Workload:
    """Pre-encode every request body once, so the timed loop only sends bytes."""
    planned = [config.requests_for(level) for level in config.concurrency]
    if config.prompt_file is not None:
        conversations = read_prompt_file(config.prompt_file)
        note = f"{len(conversations)} prompts from {config.prompt_file}"
    else:
        count = min(_MAX_SYNTHETIC, sum(n or _MAX_SYNTHETIC for n in planned))
        prompts = synthetic_prompts(count, config.input_tokens, tokenizer, seed=config.seed)
        conversations = [[{"role": "user", "content": prompt}] for prompt in prompts]
        if tokenizer is None:
            note = f"synthetic, ~{config.input_tokens} tokens each (estimated: one word per token)"
        else:
            note = f"synthetic, {config.input_tokens} tokens each by {tokenizer.name}"
    counts = [n for n in planned if n is not None]
    note += _repeats(len(conversations), sum(counts) if len(counts) == len(planned) else None)
    bodies = tuple(_body(config, messages) for messages in conversations)
    return Workload(bodies=bodies, tokenizer=tokenizer, prompt_note=note)


def _repeats(distinct: int, requests: int | None) -> str:
    """What the note says of a run that sends (or, run for a duration: `requests` None, may
    send) some prompts again: a response cache in the path would answer those."""
    if requests is None:
        repeat = f"a timed run may send its {distinct} distinct prompts again"
    elif requests > distinct:
        repeat = f"{requests} requests over {distinct} distinct prompts sends some again"
    else:
        return ""
    return f"; {repeat} (a cache may answer them)"


def _body(config: BenchConfig, messages: Messages) -> bytes:
    body: dict[str, Any] = {
        "model": config.model,
        "messages": messages,
        "max_tokens": config.max_tokens,
        "stream": config.stream,
    }
    if config.stream:
        body["stream_options"] = {"include_usage": True}
    body.update(config.extra_body)
    return orjson.dumps(body)
