"""Cheap checks that veto a semantic hit two similar questions should not share.

Embeddings see "flights in 2023" and "flights in 2024" as near twins; the answer differs. Each
guard kept here raised precision on labelled question pairs (benchmarks/semantic_cache.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType

__all__ = ["GUARDS", "Guard", "compatible", "guarded_by"]

Guard = Callable[[str, str], bool]
"""(query, cached) -> True when the guard lets the cached answer serve the query."""

_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_WORD = re.compile(r"[\w’'-]+")
# A capitalised Latin word that does not start the text or a sentence.
_CAPITALISED = re.compile(r"(?<![.?!]\s)(?<!^)\b[A-Z][\w’'-]*")
_SEPARATORS = re.compile(r"[\s\-_.’']+")
_SWAP_MAX = 2
"""More unmatched names than this on a side is a rewording (lists, acronyms), not a swap."""
_RUN_TOGETHER_MAX = 32
"""At most this many names are looked for run together in the other question (more are a list
anyway): each look reads the whole of it, and a question of 40,000 names took 7.6 s."""
_NEGATIONS = frozenset({"not", "never", "no", "cannot", "nothing", "nobody", "nowhere", "none"})
_CONTRACTED = {"won't": "will", "can't": "can", "shan't": "shall", "ain't": "is"}
_AUXILIARIES = frozenset({"do", "does", "did"})
_ASIDES = re.compile(r"\b(?:or|why|if) (?:not|no)\b")
_DIRECTIONAL = frozenset({"to", "into", "than", "from", "before", "after"})
_OPPOSITES = (
    ("increase", "decrease"),
    ("increase", "reduce"),
    ("gain", "lose"),
    ("win", "lose"),
    ("like", "hate"),
    ("love", "hate"),
    ("best", "worst"),
    ("good", "bad"),
    ("advantage", "disadvantage"),
    ("advantages", "disadvantages"),
    ("pros", "cons"),
    ("first", "second"),
    ("first", "last"),
    ("public", "private"),
    ("strongest", "weakest"),
    ("before", "after"),
    ("similar", "differ"),
    ("similarities", "differences"),
    ("start", "stop"),
    ("buy", "sell"),
    ("import", "export"),
    ("male", "female"),
    ("men", "women"),
    ("boy", "girl"),
    ("boys", "girls"),
    ("positive", "negative"),
    ("cheap", "expensive"),
    ("rich", "poor"),
    ("high", "low"),
    ("higher", "lower"),
    ("legal", "illegal"),
    ("true", "false"),
    ("easy", "hard"),
    ("easiest", "hardest"),
    ("fast", "slow"),
    ("old", "new"),
)


def numbers(query: str, cached: str) -> bool:
    """When both questions hold numbers, the same ones in the same order: "SAT score 1310" is
    not "1270", nor "Is 7 greater than 3?" "Is 3 greater than 7?" (0.996 on MiniLM).

    A number on one side only (often a year or a detail added to the same question) passes:
    on the dev pairs that rule vetoed 4 duplicates per 17 non-duplicates, the strict one 1 to 1.
    The order cost one duplicate of the 934 and no hit at 0.92 or above.
    """
    mine, theirs = _numbers(query), _numbers(cached)
    return not (mine and theirs) or mine == theirs


def names(query: str, cached: str) -> bool:
    """No name swapped for another: "dog parks in Travis County" is not "in Hays County".

    A name only one side has (an added detail) passes; each side naming one or two things the
    other never mentions, in any case or spelling run together, fails. Only Latin capitals
    count, so a Chinese question always passes.
    """
    mine, theirs = _unmatched(query, cached), _unmatched(cached, query)
    return not (mine and theirs and len(mine) <= _SWAP_MAX and len(theirs) <= _SWAP_MAX)


def opposites(query: str, cached: str) -> bool:
    """No word swapped for its opposite: "increase my credit limit" is not "reduce" it."""
    mine, theirs = _words(query), _words(cached)
    for one, other in _OPPOSITES:
        if _swapped(one, other, mine, theirs) or _swapped(other, one, mine, theirs):
            return False
    return True


def negation(query: str, cached: str) -> bool:
    """Not the same question with a "not" added: "Is it safe to drink tap water in Mexico?" is
    not "Is it not safe to ..." (0.994 on MiniLM), nor "Why isn't the sky blue?".

    Only where the words are otherwise the same (an auxiliary "do" aside): a negation in other
    words ("How do I not sleep in class?", "How can I avoid sleeping in class?") is often the
    same question, and a guard on any "not" vetoed as many duplicates as it saved.
    """
    mine, theirs = _negated(query), _negated(cached)
    return mine[0] == theirs[0] or mine[1] != theirs[1]


def direction(query: str, cached: str) -> bool:
    """No two words swapped across a "to" or "than": "convert Celsius to Fahrenheit" is not
    "Fahrenheit to Celsius" (0.995 on MiniLM), nor "move from Python to Java" the other way.

    Only a swap around such a word: any reordering ("Why Delhi is ...", "Why is Delhi ...")
    vetoed four duplicates per non-duplicate on the dev pairs, and "A and B" is "B and A".
    """
    mine, theirs = _ordered(query), _ordered(cached)
    if len(mine) != len(theirs):
        return True
    apart = [i for i, (one, other) in enumerate(zip(mine, theirs, strict=True)) if one != other]
    if len(apart) != 2:
        return True
    first, last = apart
    swapped = mine[first] == theirs[last] and mine[last] == theirs[first]
    return not (swapped and not _DIRECTIONAL.isdisjoint(mine[first + 1 : last]))


GUARDS: Mapping[str, Guard] = MappingProxyType(
    {
        "numbers": numbers,
        "names": names,
        "opposites": opposites,
        "negation": negation,
        "direction": direction,
    }
)
"""Every guard by name, for measuring each one's effect."""


def guarded_by(chosen: Iterable[str]) -> Guard:
    """A check that passes when every one of the `chosen` guards does."""
    checks = tuple(GUARDS[name] for name in chosen)
    return lambda query, cached: all(check(query, cached) for check in checks)


def compatible(query: str, cached: str) -> bool:
    """False when the two questions differ in a way that changes the answer."""
    return (
        numbers(query, cached)
        and names(query, cached)
        and opposites(query, cached)
        and negation(query, cached)
        and direction(query, cached)
    )


def _numbers(text: str) -> list[str]:
    return [number.replace(",", "") for number in _NUMBER.findall(text)]


def _ordered(text: str) -> list[str]:
    return [word.casefold() for word in _WORD.findall(text)]


def _negated(text: str) -> tuple[bool, frozenset[str]]:
    """Whether `text` says "not" (or "never", "n't", ...; "or not" and "why not" are asides), and
    its other words with contractions undone."""
    said, kept = False, set()
    for word in _WORD.findall(_ASIDES.sub(" ", text.casefold().replace("’", "'"))):
        if word.endswith("n't"):
            said, word = True, _CONTRACTED.get(word, word[:-3])
        elif word in _NEGATIONS:
            said, word = True, "can" if word == "cannot" else ""
        if word and word not in _AUXILIARIES:
            kept.add(word)
    return said, frozenset(kept)


def _words(text: str) -> set[str]:
    return {word.casefold() for word in _WORD.findall(text)}


def _swapped(one: str, other: str, mine: set[str], theirs: set[str]) -> bool:
    return one in mine and other in theirs and other not in mine and one not in theirs


def _unmatched(text: str, other: str) -> list[str]:
    """The names in `text` that `other` does not mention, as a word or inside a longer one."""
    words = {_stem(word) for word in _WORD.findall(other)}
    absent = [
        name
        for name in (_stem(w) for w in _CAPITALISED.findall(text) if w != "I")
        if name not in words
    ]
    if len(absent) > _RUN_TOGETHER_MAX:
        return absent  # a list, not a swap, whatever of it runs together in `other`
    run_together = _SEPARATORS.sub("", other.casefold())
    return [
        name
        for name in absent
        if not (len(name) >= 4 and _SEPARATORS.sub("", name) in run_together)
    ]


def _stem(word: str) -> str:
    """Casefolded, without a plural or possessive ending: "IIMs" and "IIM's" mean "IIM"."""
    word = word.casefold()
    for ending in ("’s", "'s", "s"):
        if word.endswith(ending) and len(word) > len(ending) + 2:
            return word[: -len(ending)]
    return word
