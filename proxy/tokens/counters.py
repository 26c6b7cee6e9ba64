"""Choosing each model's counter: `load_counter` reads a policy `tokenizer` spec, and
`TokenCounters` loads every model's counter once at startup for the request path to use (and,
on a reload, only the specs it did not have).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from proxy.policy import Policy
from proxy.tokens.base import (
    Messages,
    Prompt,
    TokenCounter,
    TokenizerError,
    Tools,
    chat_chars,
    prompt_chars,
)
from proxy.tokens.estimate import EstimateCounter
from proxy.tokens.lanes import CountLanes

__all__ = ["INLINE_MAX_CHARS", "TokenCounters", "load_counter", "load_tokenizers"]

# Inputs up to this size are counted on the event loop (up to ~0.8 ms with tiktoken, less than
# a hand-off to a worker thread costs below ~8k characters); longer ones in a worker thread, so a
# 100k-token prompt never stalls other streams for long (a few of one tenant's at a time: lanes).
INLINE_MAX_CHARS = 32_000
_log = logging.getLogger("tokenweir.tokens")
_SPECS = (
    "tiktoken:ENCODING (o200k_base, cl100k_base), hf:ORG/NAME[@REVISION], a tokenizer.json"
    " path (hf:PATH also), or a tiktoken-format file path (.tiktoken, Llama 3's tokenizer.model),"
    " optionally followed by #FORMAT (qwen2.5, qwen2, llama3.1, llama3, chatml)"
)


def load_counter(spec: str | None, *, model: str, base_dir: Path | None = None) -> TokenCounter:
    """The counter a spec names; None or "estimate" gives the estimate.

    Relative paths are resolved against `base_dir` (default: the working directory).
    Raises TokenizerError naming the model, the spec and what is wrong.
    """
    if spec is None or spec.strip() in ("", "estimate"):
        return EstimateCounter()
    try:
        return _load(spec.strip(), base_dir or Path.cwd())
    except TokenizerError as exc:
        raise TokenizerError(f"model {model!r}: tokenizer {spec!r}: {exc}") from exc
    except ImportError as exc:  # a dependency of tokenweir's own, broken or removed
        package = exc.name or "tokenizers"
        needs = f"needs the {package} package: pip install {package}"
        raise TokenizerError(f"model {model!r}: tokenizer {spec!r} {needs}") from exc


def load_tokenizers(
    policy: Policy, *, base_dir: Path | None = None
) -> dict[str | None, TokenCounter]:
    """Every tokenizer the policy's models name, loaded once each, by spec, for `TokenCounters`'
    `loaded` (e.g. `tokenweir serve` checks them before it starts the server). Raises
    TokenizerError naming the first model whose tokenizer cannot be loaded."""
    loaded: dict[str | None, TokenCounter] = {}
    for model, spec in policy.models.items():
        if spec.tokenizer is not None and spec.tokenizer not in loaded:
            loaded[spec.tokenizer] = load_counter(spec.tokenizer, model=model, base_dir=base_dir)
    return loaded


def _load(spec: str, base_dir: Path) -> TokenCounter:
    body, _, fragment = spec.partition("#")
    chat_format = fragment or None
    if body.startswith("tiktoken:"):
        from proxy.tokens import tiktoken_counter  # loaded when used

        target = body.removeprefix("tiktoken:")
        if "/" in target or target.endswith((".tiktoken", ".model")):
            return tiktoken_counter.load_file(_existing(target, base_dir), chat_format)
        if chat_format is not None:
            raise TokenizerError("#FORMAT applies to files; an OpenAI encoding uses OpenAI's rule")
        return tiktoken_counter.load_encoding(target)
    if body.startswith("hf:"):
        from proxy.tokens import hf

        target = body.removeprefix("hf:")
        local = _resolve(target, base_dir)
        if target.startswith(("/", ".", "~")) or target.endswith(".json") or local.exists():
            return hf.load_local(_existing(target, base_dir), chat_format)
        return hf.load_hub(target, chat_format)
    path = _existing(body, base_dir)
    if path.is_dir() or path.suffix == ".json":
        from proxy.tokens import hf

        return hf.load_local(path, chat_format)
    from proxy.tokens import tiktoken_counter

    return tiktoken_counter.load_file(path, chat_format)


def _resolve(target: str, base_dir: Path) -> Path:
    return base_dir / Path(target).expanduser()


def _existing(target: str, base_dir: Path) -> Path:
    path = _resolve(target, base_dir)
    if not path.exists():
        raise TokenizerError(f"no such file or directory: {path}; a tokenizer is {_SPECS}")
    return path


class TokenCounters:
    """Every model's counter, loaded once at startup; the request path only looks them up.

    Models sharing a spec share one loaded tokenizer; a model without one gets the estimate.
    `reusing` makes the counters of a reloaded policy, loading only the specs not loaded here.
    """

    __slots__ = ("_base_dir", "_by_model", "_fallback", "_inline_max_chars", "_lanes", "_loaded")

    def __init__(
        self,
        policy: Policy,
        *,
        base_dir: Path | None = None,
        inline_max_chars: int = INLINE_MAX_CHARS,
        loaded: Mapping[str | None, TokenCounter] | None = None,
        lanes: CountLanes | None = None,
    ) -> None:
        fallback: TokenCounter = EstimateCounter()
        self._loaded: dict[str | None, TokenCounter] = {None: fallback}
        previous = loaded or {}
        self._by_model: dict[str, TokenCounter] = {}
        for model, spec in policy.models.items():
            if spec.tokenizer not in self._loaded:
                counter = previous.get(spec.tokenizer)
                if counter is None:
                    counter = load_counter(spec.tokenizer, model=model, base_dir=base_dir)
                self._loaded[spec.tokenizer] = counter
            self._by_model[model] = self._loaded[spec.tokenizer]
            if not self._by_model[model].exact:
                _log.warning(
                    "model %r has no tokenizer: its token counts (quotas, rate limits, and usage "
                    "the backend does not report, labelled usage_source=estimated) are estimates; "
                    "set models.%s.tokenizer for exact counts",
                    model,
                    model,
                )
        self._fallback = fallback
        self._base_dir = base_dir
        self._inline_max_chars = inline_max_chars
        self._lanes = CountLanes() if lanes is None else lanes

    def reusing(self, policy: Policy) -> TokenCounters:
        """The counters of `policy`, sharing every tokenizer already loaded here (a reload that
        changes a price or adds a model loads nothing it had). Blocks while a new spec loads:
        call it off the event loop."""
        return TokenCounters(
            policy,
            base_dir=self._base_dir,
            inline_max_chars=self._inline_max_chars,
            loaded=self._loaded,
            lanes=self._lanes,
        )

    def for_model(self, model: str) -> TokenCounter:
        return self._by_model.get(model, self._fallback)

    def names(self) -> dict[str, str]:
        """Each model's counter name, e.g. for a startup log line."""
        return {model: counter.name for model, counter in self._by_model.items()}

    async def count_chat(self, model: str, messages: Messages, tools: Tools = None) -> int:
        counter = self.for_model(model)
        if chat_chars(messages, tools) <= self._inline_max_chars:
            return counter.count_chat(messages, tools)
        return await self._lanes.run(counter.count_chat, messages, tools)

    async def count_prompt(self, model: str, prompt: Prompt) -> int:
        counter = self.for_model(model)
        if prompt_chars(prompt) <= self._inline_max_chars:
            return counter.count_prompt(prompt)
        return await self._lanes.run(counter.count_prompt, prompt)
