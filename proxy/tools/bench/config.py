"""What one `tokenweir bench` run measures: its settings, parsed and checked once, and its error."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import orjson

__all__ = [
    "HTTP_CLIENTS",
    "MAX_CONTENT_EVENTS",
    "MAX_INPUT_TOKENS",
    "BenchConfig",
    "BenchError",
    "chat_completions_url",
    "open_files_limit",
    "parse_concurrency",
    "parse_duration_s",
    "parse_extra_body",
]

HTTP_CLIENTS = ("raw", "httpx")
# Content events one stream may have timed (and, with a tokenizer, kept): an endless stream
# once grew the bench by ~20 MB a second until its timeout. BenchConfig.max_events is lower.
MAX_CONTENT_EVENTS = 4_000_000
# The longest prompt --input-tokens may ask for (10**9 once filled the memory building it).
MAX_INPUT_TOKENS = 2_000_000
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)?\s*$")
_DURATION_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_HEADER_TEXT = re.compile(r"[\x20-\x7e]*")


class BenchError(Exception):
    """A bench setting or input that cannot work; the CLI prints it and exits with status 2."""


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """Settings for every level of one run; `api_key` is never written to results."""

    base_url: str
    model: str
    api_key: str | None = None
    concurrency: tuple[int, ...] = (1, 8, 32, 128)
    requests: int | None = None
    duration_s: float | None = None
    stream: bool = True
    input_tokens: int = 512
    max_tokens: int = 256
    prompt_file: str | None = None
    tokenizer: str | None = None
    timeout_s: float = 300.0
    seed: int = 0
    http_client: str = "raw"
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise BenchError("concurrency levels must be positive integers")
        files = open_files_limit()
        if files is not None and max(self.concurrency) > files:
            raise BenchError(
                f"concurrency {max(self.concurrency)} needs a socket for each request in flight, "
                f"more than the {files} open files this process may have (ulimit -n)"
            )
        if self.requests is not None and self.duration_s is not None:
            raise BenchError("give --requests or --duration, not both")
        if self.requests is not None and self.requests < 1:
            raise BenchError("--requests must be at least 1")
        if self.duration_s is not None and self.duration_s <= 0:
            raise BenchError("--duration must be positive")
        if self.input_tokens < 1 or self.max_tokens < 1:
            raise BenchError("--input-tokens and --max-tokens must be at least 1")
        if self.input_tokens > MAX_INPUT_TOKENS:
            raise BenchError(
                f"--input-tokens must be at most {MAX_INPUT_TOKENS:,} (the longest context "
                "windows served); each prompt is built in memory"
            )
        if self.timeout_s <= 0:
            raise BenchError("--timeout must be positive")
        if self.http_client not in HTTP_CLIENTS:
            raise BenchError(f"--http-client must be one of {', '.join(HTTP_CLIENTS)}")
        if self.api_key is not None and not _HEADER_TEXT.fullmatch(self.api_key):
            # A line break in it wrote a header of its own into every request, a non-Latin-1
            # character was a UnicodeEncodeError traceback.
            raise BenchError(
                "--api-key (or $OPENAI_API_KEY) must be printable ASCII: no line breaks, "
                "control or non-ASCII characters"
            )

    @property
    def max_events(self) -> int:
        """Content events a stream may send before the bench calls it broken: four for each
        token asked of each choice (--extra-body may ask for more of either), with room for
        role and tool events; a server that ignores max_tokens never grows the bench for ever."""
        asked = [self.max_tokens]
        asked += [
            value
            for name in ("max_tokens", "max_completion_tokens")
            if type(value := self.extra_body.get(name)) is int and value > 0
        ]
        choices = self.extra_body.get("n")
        choices = choices if type(choices) is int and choices > 0 else 1
        return min(MAX_CONTENT_EVENTS, 4 * max(asked) * choices + 64)

    def requests_for(self, concurrency: int) -> int | None:
        """Requests to send at one level; None means "until the duration runs out"."""
        if self.duration_s is not None:
            return None
        if self.requests is not None:
            return self.requests
        return max(16, 4 * concurrency)


def open_files_limit() -> int | None:
    """This process's soft limit on open files, or None where there is none (or no `resource`)."""
    try:
        import resource  # not on Windows
    except ImportError:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def parse_concurrency(text: str) -> tuple[int, ...]:
    """'1,8,32' -> (1, 8, 32); order kept, duplicates dropped."""
    levels: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not (part.isascii() and part.isdigit()) or int(part) < 1:
            raise BenchError(f"concurrency {part!r} is not a positive integer")
        if int(part) not in levels:
            levels.append(int(part))
    if not levels:
        raise BenchError("no concurrency levels given")
    return tuple(levels)


def parse_duration_s(text: str) -> float:
    """'60s', '2m', '500ms', '1h' or bare seconds ('90') -> seconds."""
    match = _DURATION_RE.match(text)
    if match is None:
        raise BenchError(f"duration {text!r} is not like 60s, 2m or 500ms")
    value_s = float(match.group(1)) * _DURATION_UNIT_S[match.group(2) or "s"]
    if value_s <= 0:
        raise BenchError(f"duration {text!r} must be positive")
    return value_s


def chat_completions_url(base_url: str) -> str:
    """The chat endpoint under `base_url`; a bare host gets the conventional /v1 prefix."""
    try:
        parts = urlsplit(base_url)
        parts.port  # noqa: B018 (raises on a port that is not a number from 0 to 65535)
    except ValueError as exc:
        raise BenchError(f"--base-url {base_url!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BenchError(f"--base-url {base_url!r} is not an http(s) URL")
    path = parts.path.rstrip("/")
    if not path:
        path = "/v1"
    query = f"?{parts.query}" if parts.query else ""  # Azure's api-version, for one
    return f"{parts.scheme}://{parts.netloc}{path}/chat/completions{query}"


def parse_extra_body(text: str) -> dict[str, Any]:
    """--extra-body: a JSON object merged into every request (e.g. {"ignore_eos": true})."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise BenchError(f"--extra-body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise BenchError("--extra-body must be a JSON object")
    return value
