"""A policy file's bytes as YAML, read safely: UTF-8 only, nesting and aliases bounded, the
line of every key and item kept for the problems found later."""

from __future__ import annotations

import re
import unicodedata
from dataclasses import replace

import yaml

from proxy.policy.problems import KeyPath, PolicyError, Problem, dotted

__all__ = [
    "ALIAS_FACTOR",
    "HAS_LIBYAML",
    "MAX_ALIASED_VALUES",
    "MAX_DEPTH",
    "decode_policy",
    "read_yaml",
]


def decode_policy(data: bytes, file: str) -> str:
    """A policy file's bytes as text: UTF-8 (a byte order mark allowed), else a PolicyError at
    the first byte that is not, rather than a traceback or a name silently changed."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        byte = data[exc.start : exc.start + 1].hex()
        message = f"byte 0x{byte} is not UTF-8: save the file as UTF-8"
        raise PolicyError([Problem(file, line, "", message)]) from None


def read_yaml(
    text: str, file: str, *, pure: bool = False
) -> tuple[object, dict[KeyPath, int], dict[KeyPath, str]]:
    """The document, the line of each key and item, and the unquoted words YAML read as
    something other than text (`off` as false), by path. libyaml reads the file when PyYAML
    has it, else, or with `pure`, PyYAML's Python reader."""
    if not _ODD_BREAK.search(text):
        return _read(text, file, pure)
    shown = _editor_lines(text)
    try:
        document, lines, words = _read(text, file, pure)
    except PolicyError as exc:
        problems = [replace(p, line=shown[p.line - 1] if p.line else 0) for p in exc.problems]
        raise PolicyError(problems) from None
    return document, {path: shown[line - 1] for path, line in lines.items()}, words


# YAML 1.1 ends a line at NEL, LS and PS too, where editors show one line going on: its line
# numbers are told as an editor counts them.
_ODD_BREAK = re.compile("[\x85\u2028\u2029]")
_YAML_BREAK = re.compile("\r\n|[\r\n\x85\u2028\u2029]")


def _editor_lines(text: str) -> list[int]:
    """The line an editor shows each of YAML's lines on (YAML's line n is item n - 1)."""
    shown, line = [1], 1
    for end in _YAML_BREAK.finditer(text):
        line += end.group() in ("\r\n", "\r", "\n")
        shown.append(line)
    return shown


def _read(
    text: str, file: str, pure: bool
) -> tuple[object, dict[KeyPath, int], dict[KeyPath, str]]:
    loader: _PureLoader | _FastLoader | None = None
    try:
        if pure or not HAS_LIBYAML:
            loader = _PureLoader(text)
        else:
            _check_depth(text, file)
            loader = _FastLoader(text)
        node = loader.get_single_node()
        if node is None:
            return None, {}, {}
        index = _LineIndex(file)
        index.walk(node, (), ())
        return loader.construct_document(node), index.lines, index.words
    except yaml.reader.ReaderError as exc:  # the position is in characters or in UTF-8 bytes
        line = len(_YAML_BREAK.findall(text, 0, text.find(chr(exc.character)))) + 1
        raise PolicyError([Problem(file, line, "", _unprintable(exc.character))]) from None
    except yaml.MarkedYAMLError as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark else 0
        deep = exc.problem == "exceeded maximum nesting depth"  # libyaml's bound (1,000)
        message = _TOO_DEEP if deep else f"invalid YAML: {exc.problem}"
        raise PolicyError([Problem(file, line, "", message)]) from None
    except yaml.YAMLError as exc:
        raise PolicyError([Problem(file, 0, "", f"invalid YAML: {exc}")]) from None
    except RecursionError:  # PyYAML's Python reader reads nested collections recursively
        line = loader.get_mark().line + 1 if isinstance(loader, _PureLoader) else 0
        raise PolicyError([Problem(file, line, "", _TOO_DEEP)]) from None
    finally:
        if loader is not None:
            loader.dispose()


class _Values(yaml.constructor.SafeConstructor):
    """PyYAML's safe constructor, whose values that cannot be built (a date with month 13, an
    integer of more digits than Python converts) are errors at their line, not a traceback."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> object:
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as exc:
            kind, value = str(node.tag).rsplit(":", 1)[-1], str(node.value)
            why = f"{len(value)} digits" if len(value) > _MAX_DIGITS else str(exc)
            problem = f"{value[:40]} is not a valid {kind} ({why}): quote it if it is text"
            raise yaml.constructor.ConstructorError(None, None, problem, node.start_mark) from None


class _PureLoader(yaml.SafeLoader, _Values):
    """PyYAML's reader in Python: slow (a 4 MB file takes tens of seconds), and everywhere."""


class _FastLoader(yaml.CSafeLoader, _Values):
    """libyaml's reader: a few times faster; it leaves the style of a plain word '', not None."""


def _check_depth(text: str, file: str) -> None:
    """Refuse collections nested more than twice MAX_DEPTH levels deep before libyaml builds
    them: PyYAML's C code builds one level by recursing once, a 999-level file overflows a
    thread's stack of 256 KiB (musl gives 128 KiB) and ends the process. libyaml's events come
    one by one without recursion, in about a sixth of the time the build takes."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.CSafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > 2 * MAX_DEPTH:
                line = event.start_mark.line + 1 if event.start_mark else 0
                raise PolicyError([Problem(file, line, "", _TOO_DEEP)])
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


HAS_LIBYAML: bool = yaml.__with_libyaml__


def _unprintable(character: int | str) -> str:
    code = character if isinstance(character, int) else ord(character)
    return (
        f"character U+{code:04X} is not allowed in YAML, even in a comment: remove it, or write "
        f"it as {_escape(code)} inside double quotes"
    )


def _escape(code: int) -> str:
    """How YAML writes the character `code` inside double quotes."""
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


# A policy is a few levels deep; a value nested deeper is a mistake (or an attack on the reader).
MAX_DEPTH = 32
# Values aliases may add by repeating their anchors': this many, or ALIAS_FACTOR times the
# values written in the file. Rules shared by every tenant fit; a "billion laughs" (aliases of
# aliases, 9 ** 9 values from a few lines) does not, nor does it in a file of many MB.
MAX_ALIASED_VALUES = 100_000
ALIAS_FACTOR = 10
# What YAML 1.1 reads an unquoted word as, other than text: `off` is false, `~` null, `1.5` a float.
_WORDS = frozenset(f"tag:yaml.org,2002:{kind}" for kind in ("bool", "null", "int", "float"))
# Python converts no longer text to an int (sys.get_int_max_str_digits()): a slow quadratic job.
_MAX_DIGITS = 4300
_HALF_PAIR = re.compile("[\ud800-\udfff]")
_NOT_A_CHARACTER = (
    "invalid YAML: an escape from \\ud800 to \\udfff is half of a UTF-16 pair, not a "
    "character: write the character itself (or \\U0001F600 for one past \\uffff)"
)
_TOO_DEEP = (
    f"values are nested more than {MAX_DEPTH} levels deep (or an alias is inside its own anchor)"
)
_ALIAS_BOMB = (
    f"aliases here repeat more values than the file holds {ALIAS_FACTOR} times over (and more "
    f"than {MAX_ALIASED_VALUES:,}): write them out"
)


class _LineIndex:
    """The line of every key and item; duplicate keys are errors, not last-one-wins. Values
    nested too deeply (an alias inside its own anchor nests without end) and aliases that
    repeat too many values are errors too: what reads the document next would not end."""

    __slots__ = ("file", "lines", "seen", "visits", "words")

    def __init__(self, file: str) -> None:
        self.file = file
        self.lines: dict[KeyPath, int] = {}
        self.words: dict[KeyPath, str] = {}
        self.seen: set[int] = set()
        self.visits = 0

    def walk(self, node: yaml.Node, path: KeyPath, site: KeyPath) -> None:
        """`site`: where the alias `node` came from is used (the nearest value not repeated)."""
        line = self.lines.setdefault(path, node.start_mark.line + 1)
        if id(node) not in self.seen:
            site = path
            self.seen.add(id(node))
        self.visits += 1
        if len(path) > MAX_DEPTH:
            raise PolicyError([Problem(self.file, line, dotted(path[:MAX_DEPTH]), _TOO_DEEP)])
        if self.visits - len(self.seen) > max(MAX_ALIASED_VALUES, ALIAS_FACTOR * len(self.seen)):
            raise PolicyError([Problem(self.file, self.lines[site], dotted(site), _ALIAS_BOMB)])
        if isinstance(node, yaml.MappingNode):
            self._mapping(node, path, site)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                self.walk(item, (*path, index), site)
        elif _is_word(node):
            self.words[path] = str(node.value)
        else:
            self._text(node, path)

    def _text(self, node: yaml.Node, path: KeyPath) -> None:
        """Refuse half a UTF-16 pair (`"\\ud800"`): PyYAML's Python reader takes it (libyaml
        does not), and no header, log line or request body could carry it."""
        value = node.value
        if isinstance(value, str) and not value.isascii() and _HALF_PAIR.search(value):
            line = node.start_mark.line + 1
            raise PolicyError([Problem(self.file, line, dotted(path), _NOT_A_CHARACTER)])

    def _mapping(self, node: yaml.MappingNode, path: KeyPath, site: KeyPath) -> None:
        keys: dict[object, tuple[str, int]] = {}  # each key as read -> as written, its line
        for key_node, value_node in node.value:
            key, line = str(key_node.value), key_node.start_mark.line + 1
            child = (*path, key)
            self._text(key_node, path)  # named by its mapping: the key cannot be printed
            same = _same_key(key_node)
            if same in keys:
                message = _duplicate(key, *keys[same])
                raise PolicyError([Problem(self.file, line, dotted(child), message)])
            keys[same] = (key, line)
            self.lines[child] = line
            if _is_word(key_node):  # recorded as pydantic names it too
                self.lines[(*path, _as_loc(key))] = line
                self.words[(*path, _as_loc(key), "[key]")] = key
            self.walk(value_node, child, site)


def _same_key(node: yaml.Node) -> object:
    """What tells a key from the others in its mapping: the value YAML reads an unquoted word
    as (`yes`, `on` and `true` are one key, as are `1` and `1.0`), or the text, in Unicode's
    NFC form (a name written precomposed and one written with a combining accent look alike
    in every report, log line and dashboard)."""
    if _is_word(node):
        return ("word", yaml.safe_load(str(node.value)))
    text = str(node.value)
    return text if text.isascii() else unicodedata.normalize("NFC", text)


def _duplicate(key: str, first: str, first_line: int) -> str:
    if key == first:
        return "duplicate key"
    if key.isascii() and first.isascii():
        return (
            f"duplicate key: YAML reads {first} (line {first_line}) and {key} unquoted as the "
            f"same key: write them in quotes"
        )
    return (
        f"duplicate key: the same name as {first!r} (line {first_line}) but for how its "
        "accents are encoded (Unicode NFC): the two would look alike wherever they are shown"
    )


def _is_word(node: yaml.Node) -> bool:
    """An unquoted scalar YAML reads as other than text."""
    return isinstance(node, yaml.ScalarNode) and node.tag in _WORDS and not node.style


def _as_loc(word: str) -> str | int:
    """How pydantic names a mapping key that YAML read as other than text (`yes` as true)."""
    value = yaml.safe_load(word)
    return int(value) if isinstance(value, bool | int) else str(value)
