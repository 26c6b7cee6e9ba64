"""A model's own Hugging Face chat template, rendered as transformers' apply_chat_template
renders it: sandboxed jinja2 with trim_blocks and lstrip_blocks, loop controls, the
`generation` tag, `raise_exception`, `strftime_now`, and a `tojson` that keeps non-ASCII text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from proxy.tokens.base import ChatTemplateError, TokenizerError, Tools

__all__ = ["HFTemplate"]


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training; renders as is."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a plain attribute)

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)  # local time, as transformers renders it


class HFTemplate:
    """A compiled chat template; renders normalised messages with the generation prompt."""

    __slots__ = ("_template", "_variables")

    def __init__(self, source: str, special_tokens: Mapping[str, object]) -> None:
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = _strftime_now
        try:
            self._template = environment.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TokenizerError(f"chat template line {exc.lineno}: {exc.message}") from exc
        self._variables: dict[str, Any] = dict(special_tokens)

    def __call__(self, messages: list[dict[str, Any]], tools: Tools) -> str:
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=True,
                **self._variables,
            )
        except (jinja2.TemplateError, TypeError, ValueError, LookupError) as exc:
            raise ChatTemplateError(f"the model's chat template rejected the chat: {exc}") from exc
