"""`log_content: true` adds prompt and completion text to the access line; keys never. Access
lines are written in batches, and every one of them arrives."""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Iterator

import openai
import pytest

from proxy.app import create_app
from proxy.telemetry.logs import PLAIN_FORMAT, BatchedLines, log_access_line
from tests.conftest import ALPHA_KEY, BACKEND_KEY, make_policy
from tests.servers import serve
from tests.stages.test_account import records

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


def test_no_content_by_default(client: openai.OpenAI, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tokenweir.access")
    client.chat.completions.create(
        model="mock-llm", messages=[{"role": "user", "content": PROMPT}], max_tokens=4
    )
    [line] = records(caplog, 1)
    assert "prompt" not in line
    assert "completion" not in line
    assert PROMPT not in caplog.records[-1].getMessage()


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
        record = make_record(self, *args, **kwargs)  # type: ignore[arg-type]
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
