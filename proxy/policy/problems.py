"""What is wrong with a policy file: each problem named by file, line and key path."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KeyPath", "PolicyError", "Problem", "by_line", "dotted", "line_of"]

KeyPath = tuple[str | int, ...]


@dataclass(frozen=True, slots=True)
class Problem:
    file: str
    line: int
    path: str
    message: str

    def __str__(self) -> str:
        where = f"{self.path}: " if self.path else ""
        return f"{self.file}:{self.line}: {where}{self.message}"


class PolicyError(ValueError):
    """A policy file that cannot be used; `problems` lists every reason found."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


def line_of(lines: dict[KeyPath, int], path: KeyPath) -> int:
    while path and path not in lines:
        path = path[:-1]
    return lines.get(path, 1)


def by_line(problems: list[Problem]) -> list[Problem]:
    return sorted(problems, key=lambda p: (p.line, p.path))


def dotted(path: KeyPath) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
