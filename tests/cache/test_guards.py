"""The semantic cache's guards: which near-twin questions may share an answer."""

from __future__ import annotations

import json

import pytest

from proxy.cache.guards import (
    GUARDS,
    compatible,
    direction,
    guarded_by,
    names,
    negation,
    numbers,
    opposites,
)
from tests.shared import shared_data

# (query, cached): the same question in other words; a hit is right.
SAME = [
    ("How do I get better at chess?", "How can I improve my chess?"),
    ("Which books teach Rust best?", "What are the best Rust books in 2024?"),
    ("Can I live on 40,000 a year in Lyon?", "Can I live on 40000 a year in Lyon?"),
    ("How hard is it to get into the IITs?", "How hard is getting into an IIT?"),
    ("Why did Norway leave Sweden?", "Why did Norway want Independence from Sweden?"),
    ("Can I store datasets in any cloud in a Pythonic way?", "Can Python store datasets?"),
    ("What is an IterableDataset?", "What is an iterable dataset?"),
    ("怎么申请退款？", "如何申请退款？"),
    ("Should I break up with my girlfriend or not?", "Should I break up with my girlfriend?"),
    ("How can I avoid sleeping in a boring class?", "How do I not sleep in a boring class?"),
    ("How do cats and dogs differ?", "How do dogs and cats differ?"),
    ("Why Delhi is a union territory?", "Why is Delhi a union territory?"),
]
# (query, cached): near twins whose answers differ; a hit is wrong.
DIFFERENT = [
    ("Which university takes an SAT score of 1310?", "... an SAT score of 1270?"),
    ("How should a 30-year-old save?", "How should a 45-year-old save?"),
    ("Is there a dog park in Travis County TX?", "Is there a dog park in Hays County TX?"),
    ("What does a taxi to the airport cost in Lisbon?", "What does it cost in Porto?"),
    ("How can I increase my credit limit?", "How can I reduce my credit limit?"),
    ("What are the advantages of remote work?", "What are the disadvantages of remote work?"),
    ("2023年的航班有哪些？", "2024年的航班有哪些？"),
    # built to collide: each scores 0.98 or more on MiniLM
    ("Is 7 greater than 3?", "Is 3 greater than 7?"),
    ("What is 12 divided by 4?", "What is 4 divided by 12?"),
    ("Is it safe to drink tap water in Mexico?", "Is it not safe to drink tap water in Mexico?"),
    ("Can I eat eggs after the expiry date?", "Can I not eat eggs after the expiry date?"),
    ("Why is the sky blue?", "Why isn't the sky blue?"),
    ("Which foods contain gluten?", "Which foods do not contain gluten?"),
    ("How do I convert Celsius to Fahrenheit?", "How do I convert Fahrenheit to Celsius?"),
    ("How do I move from Python to Java?", "How do I move from Java to Python?"),
    ("Is gold heavier than lead?", "Is lead heavier than gold?"),
]


@pytest.mark.parametrize(("query", "cached"), SAME)
def test_the_same_question_in_other_words_may_share_an_answer(query: str, cached: str) -> None:
    assert compatible(query, cached)
    assert compatible(cached, query)


@pytest.mark.parametrize(("query", "cached"), DIFFERENT)
def test_near_twins_that_ask_different_things_do_not(query: str, cached: str) -> None:
    assert not compatible(query, cached)
    assert not compatible(cached, query)


def test_each_guard_vetoes_its_own_kind_of_difference() -> None:
    assert not numbers("flights in 2023", "flights in 2024")
    assert numbers("flights in 2023", "flights")
    assert not names("Is it cold in Oslo?", "Is it cold in Rome?")
    assert names("Is it cold in Oslo, Norway?", "Is it cold in Oslo?")
    assert not opposites("Why do girls like funny guys?", "Why do girls hate funny guys?")
    assert opposites("Do you like or hate jazz?", "Do you hate jazz?")
    assert not numbers("Is 7 greater than 3?", "Is 3 greater than 7?")
    assert not negation("Will it rain?", "Won't it rain?")
    assert negation("Is time a vector?", "Is time a vector? Why or why not?")
    assert not direction("Convert 5 km to miles", "Convert 5 miles to km")


def test_names_ignore_sentence_starts_and_reworded_lists() -> None:
    assert names("Paris is lovely. Where should I stay?", "Where should I stay in lovely paris?")
    listed = "It covers Tutorials, How-to guides, Audio, Vision and Text."
    reworded = "It has Get started, Tutorials, Guides, Sound, Images, Text."
    assert names(listed, reworded)


def test_guarded_by_checks_only_the_chosen_guards() -> None:
    assert guarded_by([])("flights in 2023", "flights in 2024")
    assert not guarded_by(["numbers"])("flights in 2023", "flights in 2024")
    assert set(GUARDS) == {
        "numbers",
        "names",
        "opposites",
        "negation",
        "direction",
    }


def test_on_labelled_pairs_each_guard_vetoes_mostly_non_duplicates() -> None:
    """qqp_dev has 2.2 non-duplicate pairs per duplicate; a guard must veto far more of those."""
    path = shared_data() / "semcache" / "qqp_dev.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    for name, guard in GUARDS.items():
        vetoed = [row["label"] for row in rows if not guard(row["text_b"], row["text_a"])]
        duplicates = sum(vetoed)
        # QQP has one question with a "not" added (vetoed) and no swap across a "to": these
        # two are for what users craft.
        crafted = name in ("negation", "direction")
        least = 5 * duplicates if crafted else 5 * max(duplicates, 1)
        assert len(vetoed) - duplicates >= least, (name, vetoed)
