"""Logging for `tokenweir serve`: JSON access lines on stdout, everything else on stderr; and
the prompt and completion text an access line carries when the policy says `log_content: true`."""

from __future__ import annotations

import codecs
import io
import logging
import math
import threading
import time
from datetime import UTC, datetime
from typing import Any, TextIO

import orjson

from proxy.context import RequestContext
from proxy.doze import Doze
from proxy.jsontext import json_text
from proxy.telemetry.forks import call_in_forked_child
from proxy.telemetry.sharedwrites import in_turn, shared_lock

__all__ = [
    "ACCESS_LOGGER",
    "PLAIN_FORMAT",
    "BatchedLines",
    "content_fields",
    "flush_access_log",
    "json_line",
    "log_access_line",
    "log_config",
    "utc_ms",
]

ACCESS_LOGGER = "tokenweir.access"
PLAIN_FORMAT = "%(message)s"


def log_config(level: str = "info", *, access_log: bool = True) -> dict[str, Any]:
    """A `logging.config.dictConfig` dict, also handed to uvicorn so every worker uses it."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "plain": {"format": PLAIN_FORMAT},
            "default": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"},
        },
        "handlers": {
            "access": {
                "()": BatchedLines,
                "formatter": "plain",
                "stream": "ext://sys.stdout",
            },
            "default": {
                "class": "logging.StreamHandler",
                "formatter": "default",
                "stream": "ext://sys.stderr",
            },
        },
        "loggers": {
            ACCESS_LOGGER: {
                "handlers": ["access"],
                "level": "INFO" if access_log else "WARNING",
                "propagate": False,
            },
            "tokenweir": {"handlers": ["default"], "level": level.upper(), "propagate": False},
            "uvicorn": {"handlers": ["default"], "level": level.upper(), "propagate": False},
            "uvicorn.error": {"level": level.upper()},
            "uvicorn.access": {"handlers": [], "level": "WARNING", "propagate": False},
        },
    }


class BatchedLines(logging.StreamHandler):  # type: ignore[type-arg]
    """A stream handler that writes its lines in batches: every `flush_s`, or at once when
    `max_lines` are waiting, or at shutdown (`flush_access_log`).

    A write and a flush per access line cost a system call per request; a line now reaches
    the stream within `flush_s` (a process killed with SIGKILL loses at most that much). After
    `flush_s` with no line the flushing thread sleeps until one comes: an idle gateway does not
    wake it. Under `serve --workers N` a batch is written under a lock the workers share, so
    lines stay whole on a stdout they all write to."""

    def __init__(
        self, stream: TextIO | None = None, flush_s: float = 0.2, max_lines: int = 256
    ) -> None:
        super().__init__(_in_utf8(stream))
        self._pending: list[str] = []
        self._flush_s = flush_s
        self._max_lines = max_lines
        self._flusher: threading.Thread | None = None
        self._dozing = Doze()  # the flusher's, after flush_s with no line
        self._closed = False
        self._reader_gone = False  # stdout a pipe whose reader went away (`serve | head`)
        self._shared = shared_lock("stdout.lock")
        call_in_forked_child(self._forget_parents_lines)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._add(self.format(record))  # `handle` holds self.lock
        except Exception:  # logging's own contract: a handler reports and carries on
            self.handleError(record)

    def prints_as_is(self) -> bool:
        """True when a line logged at INFO would be written exactly as given: no filter, a
        plain `%(message)s` format."""
        formatter = self.formatter
        return (
            not self.filters
            and self.level <= logging.INFO
            and type(formatter) is logging.Formatter
            and formatter._fmt == PLAIN_FORMAT
        )

    def add(self, line: str) -> None:
        """Write `line` as `emit` would a record whose message it is (see `log_access_line`)."""
        with self.lock:  # type: ignore[union-attr]  # set by Handler.__init__
            try:
                self._add(line)
            except Exception:
                self.handleError(logging.makeLogRecord({"msg": line}))

    def _add(self, line: str) -> None:
        if self._reader_gone:
            return
        pending = self._pending
        pending.append(line)
        if len(pending) >= self._max_lines:
            self._write()
        elif len(pending) == 1:  # the first line of a batch: the flusher writes it in flush_s
            if self._flusher is None:
                self._flusher = threading.Thread(
                    target=self._flush_often, name="tw-log", daemon=True
                )
                self._flusher.start()
            else:
                self._dozing.wake()

    def flush(self) -> None:
        with self.lock:  # type: ignore[union-attr]  # set by Handler.__init__
            if not self._closed:  # a closed handler's stream may be closed too
                self._write()

    def close(self) -> None:
        with self.lock:  # type: ignore[union-attr]
            self._closed = True
        self._dozing.wake()  # the flusher ends
        super().close()

    def _write(self) -> None:
        if not self._pending:
            super().flush()
            return
        lines, self._pending = self._pending, []
        try:
            with in_turn(self._shared):  # the flush too: the stream's buffer may hold part of it
                self.stream.write(self.terminator.join(lines) + self.terminator)
                super().flush()
        except BrokenPipeError:
            # Said once, not as a traceback on stderr for every batch from now on.
            self._reader_gone = True
            logging.getLogger("tokenweir").warning(
                "access log: the reader of stdout went away; access lines are dropped from "
                "now on (--no-access-log turns them off)"
            )

    def _flush_often(self) -> None:
        while not self._closed:
            time.sleep(self._flush_s)
            if self._pending:
                try:
                    self.flush()
                except Exception:  # logging's contract; a dead flusher left lines for 256 more
                    self.handleError(logging.makeLogRecord({"msg": "(a batch of access lines)"}))
            else:  # a whole flush_s without a line: doze until one comes (or close)
                self._dozing.until(self._has_work)

    def _has_work(self) -> bool:
        return bool(self._pending) or self._closed

    def _forget_parents_lines(self) -> None:
        """In a forked child: the parent writes its own pending lines; the child gets a flusher
        of its own when it logs (threads do not survive a fork)."""
        self._pending = []
        self._dozing = Doze()
        self._flusher = None


_YEAR_10000 = 253402300800.0  # epoch seconds
_MILLIS = tuple(f".{ms:03d}+00:00" for ms in range(1000))  # a timestamp's end, by millisecond


class _UtcMs:
    """`datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds")`, its part to the
    second made once a second (the call costs about 1 µs, most of it isoformat's): microseconds
    rounded half to even as fromtimestamp rounds them, then cut to milliseconds as isoformat
    cuts them."""

    __slots__ = ("_prefix", "_second")

    def __init__(self) -> None:
        self._second = -1.0
        self._prefix = ""

    def __call__(self, ts: float) -> str:
        fraction, second = math.modf(ts)
        micros = round(fraction * 1e6)
        if micros >= 1_000_000:
            micros -= 1_000_000
            second += 1.0
        if not 0 <= micros < 1_000_000 or not 0.0 <= second < _YEAR_10000:  # 1970 to 9999 only
            return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds")
        if second != self._second:
            self._second = second
            self._prefix = datetime.fromtimestamp(second, UTC).isoformat()[:19]
        return self._prefix + _MILLIS[micros // 1000]


utc_ms = _UtcMs()
"""An access line's `ts` (epoch seconds) as ISO 8601 in UTC to the millisecond."""


def _in_utf8(stream: TextIO | None) -> TextIO | None:
    """The access lines' stream, writing UTF-8: JSON's own encoding, and what log pipelines
    read. Under a locale that is not UTF-8 (PYTHONIOENCODING=ascii, a file on Windows) the first
    line naming a tenant or user 支持 raised in the flushing thread, which died with it."""
    if isinstance(stream, io.TextIOWrapper) and codecs.lookup(stream.encoding).name != "utf-8":
        stream.reconfigure(encoding="utf-8")
    return stream


def log_access_line(log: logging.Logger, line: str) -> None:
    """`log.info(line)`, straight into the BatchedLines handler when it is the logger's one
    handler and prints lines as they are (as `tokenweir serve` sets it up): a LogRecord costs
    about 4 µs a line, most of it fields a plain format never reads (the caller's frame, the
    thread's and process's names). Any other set-up (a user's handlers, a test's capture, a
    filter) gets the record through `log.info`."""
    handlers = log.handlers
    if len(handlers) == 1 and not log.filters and not log.propagate:
        handler = handlers[0]
        if type(handler) is BatchedLines and handler.prints_as_is():
            handler.add(line)
            return
    log.info(line)


# Valid in JSON as they are, but `str.splitlines()` ends a line at U+0085 and JavaScript at
# U+2028 and U+2029: a client's or backend's string must not split an access line in two.
_LINE_BREAKS = (
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
    (b"\xc2\x85", b"\\u0085"),
)


def json_line(fields: dict[str, object]) -> str:
    """`fields` as one line of JSON, every line break escaped (orjson leaves three as they
    are); json.loads reads back the same strings."""
    try:
        dumped = orjson.dumps(fields)
    except orjson.JSONEncodeError:  # a prompt nested past orjson's 254 levels (a refused body)
        dumped = json_text(fields).encode()
    if not dumped.isascii():  # most lines are: 0.06 µs, where the three searches cost 1.4
        for raw, escaped in _LINE_BREAKS:  # UTF-8 synchronises: only that character matches
            dumped = dumped.replace(raw, escaped)
    return dumped.decode()


def flush_access_log() -> None:
    """Write out the access lines still batched: the app's shutdown calls this, since uvicorn
    ends the process by raising the SIGTERM it caught again, which skips `atexit` (and with it
    logging's own flush at exit)."""
    for handler in logging.getLogger(ACCESS_LOGGER).handlers:
        handler.flush()


def content_fields(ctx: RequestContext) -> dict[str, object]:
    """`prompt` (as sent to the backend) and `completion` text, for `log_content: true` only."""
    body = ctx.body
    prompt = body.get("messages", body.get("prompt", body.get("input")))
    cached = ctx.cached
    if cached is not None:  # a cache hit: the stored answer is what the client read
        text = cached.text if cached.message is None else cached.message.get("content")
        completion = text if isinstance(text, str) else None
    elif ctx.stream:
        relayed = ctx.capture.data() if ctx.capture is not None else None
        completion = _streamed_text(relayed or b"")
    else:
        completion = _whole_text(ctx.outcome.tail)
    return {"prompt": prompt, "completion": completion}


def _streamed_text(relayed: bytes) -> str | None:
    parts: list[str] = []
    for line in relayed.splitlines():
        if not line.startswith(b"data:") or line.endswith(b"[DONE]"):
            continue
        try:
            event = orjson.loads(line[5:])
        except orjson.JSONDecodeError:
            continue
        if not isinstance(event, dict):
            continue
        if "choices" in event:
            parts.extend(_texts(event["choices"], "delta"))
        elif event.get("type") == "content_block_delta":  # Messages
            parts.extend(_typed_texts([event.get("delta")], "text_delta"))
        elif event.get("type") == "response.output_text.delta":  # Responses
            delta = event.get("delta")
            parts.extend([delta] if isinstance(delta, str) else ())
    return "".join(parts) if parts else None


def _whole_text(raw: bytes) -> str | None:
    try:
        answer = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        return None
    if not isinstance(answer, dict):
        return None
    if "choices" in answer:
        parts = _texts(answer["choices"], "message")
    elif isinstance(answer.get("output"), list):  # Responses: its messages' output_text parts
        messages = [item for item in answer["output"] if isinstance(item, dict)]
        parts = [
            text
            for item in messages
            if item.get("type") == "message"
            for text in _typed_texts(item.get("content"), "output_text")
        ]
    else:  # Messages: its text blocks
        parts = _typed_texts(answer.get("content"), "text")
    return "".join(parts) if parts else None


def _typed_texts(parts: object, kind: str) -> list[str]:
    """The `text` of each part of type `kind` (a Messages block or delta, a Responses part)."""
    found = parts if isinstance(parts, list) else ()
    return [
        part["text"]
        for part in found
        if isinstance(part, dict) and part.get("type") == kind and isinstance(part.get("text"), str)
    ]


def _texts(choices: object, field: str) -> list[str]:
    """The text of each choice: `{field}.content` (chat) or `text` (completions)."""
    texts: list[str] = []
    for choice in choices if isinstance(choices, list) else ():
        if not isinstance(choice, dict):
            continue
        message = choice.get(field)
        text = message.get("content") if isinstance(message, dict) else None
        text = text if isinstance(text, str) else choice.get("text")
        if isinstance(text, str):
            texts.append(text)
    return texts
