"""The docs' evidence stays findable: every test they cite by name is a test in tests/, every
file of the repository they name exists (a test renamed or moved left its citation behind),
every link between them reaches its heading, and every error code they give is the gateway's."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_TEST = re.compile(r"`(test_\w+)`")
_PATH = re.compile(
    r"(?<![\w/.])((?:tests|proxy|benchmarks|examples|policies|docs)/[\w./*{},-]*[\w}])"
)


def _cited(pattern: re.Pattern[str]) -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            where = f"{page.relative_to(ROOT)}:{number}"
            found += [(where, name) for name in pattern.findall(line)]
    return found


def test_every_test_the_docs_cite_exists() -> None:
    defined: set[str] = set()
    for module in (ROOT / "tests").rglob("test_*.py"):
        defined |= set(re.findall(r"def (test_\w+)", module.read_text(encoding="utf-8")))
    cited = _cited(_TEST)
    assert len(cited) > 50
    assert [(where, name) for where, name in cited if name not in defined] == []


def test_every_file_the_docs_name_exists() -> None:
    named = _cited(_PATH)
    assert len(named) > 50
    # A pattern (`test_*_contract.py`, `x.{md,json}`) names several files: not checked here.
    missing = [
        (where, path)
        for where, path in named
        if not re.search(r"[*{]", path) and not (ROOT / path.rstrip(".,")).exists()
    ]
    assert missing == []


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    return {_slug(heading) for heading in re.findall(r"^#+ (.*)$", text, re.M)}


def test_every_link_between_the_docs_reaches_its_page_and_heading() -> None:
    links = _cited(re.compile(r"\]\(([^)\s]+)\)"))
    assert len(links) > 20
    broken = []
    for where, target in links:
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        page = ROOT / where.split(":")[0]
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists() or (anchor and anchor not in _anchors(linked)):
            broken.append((where, target))
    assert broken == []


def test_every_error_code_the_docs_give_a_status_is_one_the_gateway_writes() -> None:
    """`400 `unsupported_parameter``, `503 `overloaded``: the code is in the gateway's source (a
    code renamed there left the docs promising the old one)."""
    source = "\n".join(m.read_text(encoding="utf-8") for m in (ROOT / "proxy").rglob("*.py"))
    # Made from its parts: `f"{what}_not_found"` for a stored object (proxy/stages/stored.py).
    made = {"previous_response_not_found"}
    codes = _cited(re.compile(r"\b[45]\d\d `([a-z][a-z_]+)`"))
    assert len(codes) > 20
    assert [(where, c) for where, c in codes if c not in made and f'"{c}"' not in source] == []
