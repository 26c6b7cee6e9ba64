"""`log_content: true` adds prompt and completion text to the access line; keys never. Access
lines are written in batches, and every one of them arrives; their times are isoformat's."""

from __future__ import annotations

import io
import logging
import os
import random
import time
import warnings
from collections.abc import Iterator
from datetime import UTC, datetime
from functools import reduce
from pathlib import Path

import anthropic
import httpx
import openai
import orjson
import pytest

from proxy.app import create_app
from proxy.jsontext import json_text
from proxy.telemetry.logs import PLAIN_FORMAT, BatchedLines, log_access_line, utc_ms
from tests.conftest import ALPHA_KEY, BACKEND_KEY, make_policy
from tests.servers import serve
from tests.stages.test_account import records
from tests.telemetry.scripted import chunk, scripted_backend

PROMPT = "tell me about weirs"


@pytest.fixture(scope="module")
def logging_gateway(backend_url: str) -> Iterator[str]:
    with serve(create_app(make_policy(backend_url, extra="log_content: true\n"))) as url:
        yield url


def test_prompt_and_completion_are_logged_when_asked(
    logging_gateway: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    messages = [{"role": "user", "content": PROMPT}]
    with openai.OpenAI(base_url=logging_gateway + "/v1", api_key=ALPHA_KEY, max_retries=0) as sdk:
        streamed = "".join(
            chunk.choices[0].delta.content or ""
            for chunk in sdk.chat.completions.create(
                model="mock-llm", messages=messages, max_tokens=8, stream=True
            )
            if chunk.choices
        )
        whole = sdk.chat.completions.create(model="mock-llm", messages=messages, max_tokens=8)
    stream_line, whole_line = records(caplog, 2)
    assert stream_line["prompt"] == messages
    assert stream_line["completion"] == streamed
    assert whole_line["completion"] == whole.choices[0].message.content
    for record in caplog.records:
        assert ALPHA_KEY not in record.getMessage()
        assert BACKEND_KEY not in record.getMessage()


def test_agent_api_completions_are_logged_when_asked(
    logging_gateway: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Messages and Responses, whole and streamed: `completion` is the text the client read (it
    was null: only chat's `choices` were read)."""
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    messages = [{"role": "user", "content": PROMPT}]
    with anthropic.Anthropic(base_url=logging_gateway, api_key=ALPHA_KEY, max_retries=0) as sdk:
        whole = sdk.messages.create(model="mock-llm", max_tokens=8, messages=messages)
        with sdk.messages.stream(model="mock-llm", max_tokens=8, messages=messages) as stream:
            streamed = "".join(stream.text_stream)
    read = [whole.content[0].text, streamed]
    with openai.OpenAI(base_url=logging_gateway + "/v1", api_key=ALPHA_KEY, max_retries=0) as oai:
        read.append(oai.responses.create(model="mock-llm", input=PROMPT).output_text)
        events = oai.responses.create(model="mock-llm", input=PROMPT, stream=True)
        read.append("".join(e.delta for e in events if e.type == "response.output_text.delta"))
    lines = records(caplog, 4)
    assert all(read), read
    assert [line["completion"] for line in lines] == read
    assert [line["prompt"] for line in lines] == [messages, messages, PROMPT, PROMPT]


def test_a_prompt_too_deep_to_send_is_refused_and_logged(
    logging_gateway: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A prompt nested past what orjson writes is a 400; its access line is still written,
    with the prompt as sent (it was lost, and a traceback logged in its place)."""
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    messages = [{"role": "user", "content": reduce(lambda inner, _: [inner], range(300), [])}]
    body = b'{"model": "mock-llm", "messages": ' + json_text(messages).encode() + b"}"
    headers = {"authorization": f"Bearer {ALPHA_KEY}", "content-type": "application/json"}
    answer = httpx.post(logging_gateway + "/v1/chat/completions", content=body, headers=headers)
    assert answer.status_code == 400
    [line] = records(caplog, 1)
    assert (line["status"], line["error"]) == (400, "invalid_value")
    assert line["prompt"] == messages


def test_no_content_by_default(client: openai.OpenAI, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    client.chat.completions.create(
        model="mock-llm", messages=[{"role": "user", "content": PROMPT}], max_tokens=4
    )
    [line] = records(caplog, 1)
    assert "prompt" not in line
    assert "completion" not in line
    assert PROMPT not in caplog.records[-1].getMessage()


BREAKS = "\u2028\u2029\x85"  # line ends to str.splitlines() or JavaScript, not to JSON


def test_line_breaks_in_logged_strings_leave_each_access_line_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client's prompt and model name and a backend's answer and error code, each with
    U+2028, U+2029 and U+0085, are escaped: each access line is one line to splitlines() (as to
    a JavaScript reader) and reads back as the same strings."""
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    scripts = {
        "ask" + BREAKS: [chunk({"content": "an" + BREAKS + "swer"}, "stop"), b"data: [DONE]\n\n"],
        "fail": (400, {"message": "no", "type": "invalid_request_error", "code": "x" + BREAKS}),
    }
    with (
        serve(scripted_backend(scripts)) as backend,
        serve(create_app(make_policy(backend, extra="log_content: true\n"))) as gateway,
        openai.OpenAI(base_url=gateway + "/v1", api_key=ALPHA_KEY, max_retries=0) as sdk,
    ):
        for model, text in (("mock-llm", "ask" + BREAKS), ("mock-llm", "fail"), (BREAKS, "ask")):
            messages = [{"role": "user", "content": text}]
            try:
                for _ in sdk.chat.completions.create(model=model, messages=messages, stream=True):
                    pass
            except openai.APIStatusError:
                pass
        records(caplog, 3)  # the last may be logged just after its answer's end
        lines = [r.getMessage() for r in caplog.records if r.name == "tokenweir.access"]
    assert [len(line.splitlines()) for line in lines] == [1, 1, 1]
    answered, refused, unknown = (orjson.loads(line) for line in lines)
    assert answered["prompt"] == [{"role": "user", "content": "ask" + BREAKS}]
    assert answered["completion"] == "an" + BREAKS + "swer"
    assert refused["error"] == "x" + BREAKS
    assert unknown["model_requested"] == BREAKS


def _logger(handler: logging.Handler, name: str) -> logging.Logger:
    logger = logging.getLogger(name)
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger


def test_batched_lines_arrive_soon_without_more_traffic() -> None:
    stream = io.StringIO()
    handler = BatchedLines(stream, flush_s=0.05)
    log = _logger(handler, "tokenweir.test.batched.soon")
    log.info("one")
    log.info("two")
    deadline = time.monotonic() + 30  # the flusher runs every 0.05 s; a loaded machine is slow
    while stream.getvalue() != "one\ntwo\n" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stream.getvalue() == "one\ntwo\n"
    handler.close()


def _arrives(stream: io.StringIO, text: str) -> None:
    deadline = time.monotonic() + 30  # the flusher waits flush_s; a loaded machine is slow
    while stream.getvalue() != text and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stream.getvalue() == text


def test_batched_lines_flusher_sleeps_while_idle_and_the_next_line_wakes_it() -> None:
    """An idle gateway's log flusher does not wake every flush_s to find nothing to write (each
    wake is CPU an idle gateway burns); a line logged after the idle spell still arrives."""
    stream = io.StringIO()
    handler = BatchedLines(stream, flush_s=0.02)
    log = _logger(handler, "tokenweir.test.batched.idle")
    log.info("one")
    _arrives(stream, "one\n")
    flushes: list[float] = []
    flush = handler.flush

    def counted() -> None:
        flushes.append(time.monotonic())
        flush()

    handler.flush = counted  # type: ignore[method-assign]
    time.sleep(0.5)  # 25 rounds of a flusher that polls
    idle_flushes = len(flushes)
    log.info("two")
    _arrives(stream, "one\ntwo\n")
    handler.close()
    assert idle_flushes <= 1


def test_a_forked_child_writes_its_own_lines_and_not_its_parents(tmp_path: Path) -> None:
    """A line waiting in the parent at the fork is the parent's to write, once; the child's
    lines reach the stream through a flusher of the child's own (threads do not survive)."""
    path = tmp_path / "access.log"
    with path.open("w") as stream:
        handler = BatchedLines(stream, flush_s=0.02)
        log = _logger(handler, "tokenweir.test.batched.fork")
        log.info("parent")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # 3.12: fork with threads
            pid = os.fork()
        if pid == 0:  # the child: log, and wait for its own flusher to write the line
            code = 1
            try:
                log.info("child")
                deadline = time.monotonic() + 30
                while "child" not in path.read_text() and time.monotonic() < deadline:
                    time.sleep(0.01)
                code = 0 if "child" in path.read_text() else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        handler.flush()
        handler.close()
    assert os.waitstatus_to_exitcode(status) == 0
    assert sorted(path.read_text().splitlines()) == ["child", "parent"]


def test_batched_lines_are_written_at_once_when_the_batch_is_full_and_at_close() -> None:
    stream = io.StringIO()
    handler = BatchedLines(stream, flush_s=3600, max_lines=3)  # the timer never writes here
    log = _logger(handler, "tokenweir.test.batched.full")
    log.info("a")
    log.info("b")
    assert stream.getvalue() == ""
    log.info("c")
    assert stream.getvalue() == "a\nb\nc\n"
    log.info("d")
    handler.flush()  # what logging.shutdown does at exit
    assert stream.getvalue() == "a\nb\nc\nd\n"
    handler.close()


def _serving_logger(handler: BatchedLines, name: str) -> logging.Logger:
    """A logger set up as `tokenweir serve` sets the access logger (proxy.telemetry.logs)."""
    handler.setFormatter(logging.Formatter(PLAIN_FORMAT))
    return _logger(handler, name)


def test_an_access_line_skips_the_log_record_only_where_it_would_print_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As `serve` sets it up, the line goes straight to the handler and is written as logged;
    with any formatter, filter or second handler of a user's, logging's record is made."""
    made: list[str] = []
    make_record = logging.Logger.makeRecord

    def spied(self: logging.Logger, *args: object, **kwargs: object) -> logging.LogRecord:
        record = make_record(self, *args, **kwargs)
        made.append(record.getMessage())
        return record

    monkeypatch.setattr(logging.Logger, "makeRecord", spied)
    stream = io.StringIO()
    handler = BatchedLines(stream, flush_s=3600)
    log = _serving_logger(handler, "tokenweir.test.batched.plain")
    log_access_line(log, '{"status": 200, "note": "100% %s"}')
    assert made == []  # no record: the point of the fast path
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log_access_line(log, "formatted")
    handler.setFormatter(logging.Formatter(PLAIN_FORMAT))
    log.addFilter(lambda record: record.getMessage() != "filtered")
    log_access_line(log, "filtered")
    handler.flush()
    assert stream.getvalue() == '{"status": 200, "note": "100% %s"}\nINFO formatted\n'
    assert made == ["formatted", "filtered"]
    handler.close()


@pytest.mark.parametrize(
    "ts",
    [
        0.0, 1764960000.0, 1764960000.9995, 1764960000.0005, 1764960059.9999995,
        1764960059.9999994, 1764960000.0000005, 1764960000.0000015, 253402300799.999,
        -1.5, 253402300800.5,
    ],
)  # fmt: skip
def test_an_access_lines_time_is_what_isoformat_writes(ts: float) -> None:
    """To the millisecond, rounded and cut as datetime does, on and around a second's edge; a
    time datetime cannot write fails as it fails. Then 3 s later (a new second's prefix)."""
    for each in (ts, ts + 3.0):
        try:
            expected = isoformat(each)
        except (ValueError, OverflowError) as exc:
            with pytest.raises(type(exc)):
                utc_ms(each)
        else:
            assert utc_ms(each) == expected


def isoformat(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds")


def test_many_access_line_times_are_what_isoformat_writes() -> None:
    rng = random.Random(16)  # noqa: S311  # times to test, not secrets
    for _ in range(20_000):
        ts = 1_764_960_000 + rng.randrange(10**8) / 1e6 + rng.choice([0.0, 5e-7, -5e-7])
        assert utc_ms(ts) == isoformat(ts)


def test_access_lines_are_utf8_whatever_the_locale() -> None:
    """Under PYTHONIOENCODING=ascii (or a file on Windows, cp1252) the first line naming a
    tenant 支持 raised UnicodeEncodeError in the flushing thread, and its batch was lost."""
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding="ascii")
    handler = BatchedLines(stream, flush_s=3600, max_lines=2)
    log = _serving_logger(handler, "tokenweir.test.batched.ascii")
    log.info('{"tenant":"支持"}')
    log.info('{"tenant":"ok"}')
    handler.flush()
    assert raw.getvalue().decode() == '{"tenant":"支持"}\n{"tenant":"ok"}\n'
    handler.close()


class _FailsOnce(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    def write(self, text: str) -> int:
        if not self.failed:
            self.failed = True
            raise OSError("the disk was full for a moment")
        return super().write(text)


def test_the_flusher_outlives_a_failed_write(capsys: pytest.CaptureFixture[str]) -> None:
    """A write that raised killed the flushing thread: later lines waited for 256 more."""
    stream = _FailsOnce()
    handler = BatchedLines(stream, flush_s=0.02)
    log = _serving_logger(handler, "tokenweir.test.batched.fails")
    log.info("lost")
    deadline = time.monotonic() + 30
    while not stream.failed and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # the flusher reports the failed write and goes on (or, before, died)
    log.info("kept")
    _arrives(stream, "kept\n")
    handler.close()
    assert "the disk was full" in capsys.readouterr().err


class _ClosedPipe(io.StringIO):
    def write(self, text: str) -> int:
        self.tried = getattr(self, "tried", 0) + 1
        raise BrokenPipeError(32, "Broken pipe")


def test_a_stdout_whose_reader_went_away_is_said_once_not_as_a_traceback_a_batch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`tokenweir serve | head -1`: each batch of access lines printed a BrokenPipeError
    traceback ("--- Logging error ---") on stderr, five a second under traffic."""
    records: list[logging.LogRecord] = []
    told = logging.Handler()
    told.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("tokenweir").addHandler(told)
    stream = _ClosedPipe()
    handler = BatchedLines(stream, flush_s=3600, max_lines=1)  # each line its own batch
    log = _logger(handler, "tokenweir.test.batched.gone")
    try:
        for n in range(5):
            log.info("line %d", n)
    finally:
        handler.close()
        logging.getLogger("tokenweir").removeHandler(told)
    assert stream.tried == 1
    assert "Logging error" not in capsys.readouterr().err
    said = [r.getMessage() for r in records if r.name == "tokenweir"]
    assert said == [
        "access log: the reader of stdout went away; access lines are dropped from now on "
        "(--no-access-log turns them off)"
    ]
