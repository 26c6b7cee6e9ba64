"""Every `tokenweir COMMAND ... --flag` that README.md and docs/ write takes that flag: a command
line copied from the docs is never refused for a flag the command does not have; and every
`pip install 'tokenweir[extra]'` they or an error message give names a declared extra."""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path

from proxy.cli import _parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A command line in a page: inline code or a line of a shell block that starts a command.
_LINE = re.compile(r"`(tokenweir [^`]+)`|^\s*(tokenweir [^#\n]+)", re.M)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def _commands() -> dict[str, set[str]]:
    """Each command ("serve", "policy check", "keys create") with the flags it takes; a command
    named without its subcommand ("keys", "keys create|list|revoke") with any of theirs."""
    flags: dict[str, set[str]] = {}
    for name, parser in _subcommands(_parser()).items():
        flags[name] = _flags(parser)
        for sub, subparser in _subcommands(parser).items():
            flags[f"{name} {sub}"] = _flags(subparser)
            flags[name] |= flags[f"{name} {sub}"]
    return flags


def _written() -> list[tuple[str, str, str]]:
    """(where, command, flag) of every flag written after `tokenweir COMMAND` in the pages."""
    commands = _commands()
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in _LINE.finditer(text):
            line = match.group(1) or match.group(2)
            words = line.split()
            command = " ".join(words[1:3])
            if command not in commands:
                command = words[1] if len(words) > 1 else ""
            if command not in commands:
                continue  # prose ("tokenweir is ...")
            where = f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}"
            found += [(where, command, flag) for flag in re.findall(r"(--[a-z][\w-]*)", line)]
    return found


def test_every_flag_the_docs_write_is_the_commands() -> None:
    commands = _commands()
    written = _written()
    assert len(written) > 20
    unknown = [(where, c, flag) for where, c, flag in written if flag not in commands[c] | {"--"}]
    assert unknown == []


def test_every_extra_named_in_the_docs_or_an_error_is_declared() -> None:
    """`pip install 'tokenweir[x]'` of an extra that is not declared warns and installs nothing."""
    declared = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    texts = [page.read_text(encoding="utf-8") for page in PAGES]
    texts += [module.read_text(encoding="utf-8") for module in (ROOT / "proxy").rglob("*.py")]
    named = {
        extra
        for text in texts
        for group in re.findall(r"(?:tokenweir|\.)\[([a-z][a-z,-]*)\]", text)
        for extra in group.split(",")
    }
    assert len(named) >= 3
    assert named - declared == set()


def test_readme_s_command_table_names_every_command() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text.split("## Commands", 1)[1].split("\n## ", 1)[0]
    named = " ".join(re.findall(r"^\| `(tokenweir [^`]+)`", table, re.M))
    words = set(re.split(r"[\s|\\\[\]]+", named))
    for command in _commands():
        assert set(command.split()) <= words, f"tokenweir {command} is not in README's Commands"
