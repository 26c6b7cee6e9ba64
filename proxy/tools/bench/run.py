"""`tokenweir bench`: measure an OpenAI-compatible endpoint level by level of concurrency.

Flags, the run across levels and the exit status; the work is in the sibling modules.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from proxy.exitstatus import INTERRUPTED, READER_GONE, TERMINATED, USAGE
from proxy.tools import runloop
from proxy.tools.bench.config import (
    HTTP_CLIENTS,
    BenchConfig,
    BenchError,
    chat_completions_url,
    parse_concurrency,
    parse_duration_s,
    parse_extra_body,
)
from proxy.tools.bench.level import LevelProgress, LevelResult, open_transport, run_level
from proxy.tools.bench.prompts import Workload, build_workload, load_tokenizer
from proxy.tools.bench.report import (
    ProgressLine,
    check_output_paths,
    config_json,
    format_table,
    level_json,
    level_line,
    result_document,
    write_json,
    write_plot,
)
from proxy.tools.bench.stats import VERDICT_BANDS, Summary, percentile, verdict
from proxy.tools.textout import StatusLines

__all__ = [
    "VERDICT_BANDS",
    "BenchConfig",
    "BenchError",
    "LevelProgress",
    "LevelResult",
    "Summary",
    "Workload",
    "add_arguments",
    "build_workload",
    "config_from_args",
    "config_json",
    "level_json",
    "load_tokenizer",
    "main",
    "open_transport",
    "percentile",
    "run",
    "run_level",
    "verdict",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `bench` flags to its subparser."""
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--model", required=True, help="model name sent in every request")
    parser.add_argument("--api-key", help="bearer token (default: $OPENAI_API_KEY, if set)")
    parser.add_argument(
        "--concurrency", default="1,8,32,128", help="comma-separated levels (default: 1,8,32,128)"
    )
    amount = parser.add_mutually_exclusive_group()
    amount.add_argument(
        "--requests", type=int, help="requests per level (default: 4 x concurrency, at least 16)"
    )
    amount.add_argument("--duration", help="time per level instead, e.g. 60s or 2m")
    parser.add_argument(
        "--stream", action=argparse.BooleanOptionalAction, default=True, help="(default: on)"
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--prompt-file", help="one prompt per line, or JSONL with 'prompt' or 'messages'"
    )
    source.add_argument("--dataset", choices=["synthetic"], default="synthetic")
    parser.add_argument(
        "--input-tokens", type=int, default=512, help="synthetic prompt length (default: 512)"
    )
    parser.add_argument("--max-tokens", type=int, default=256, help="(default: 256)")
    parser.add_argument(
        "--tokenizer",
        help="tiktoken:ENCODING or a tokenizer.json path; counts tokens when the server "
        "reports no usage, and sizes synthetic prompts exactly",
    )
    parser.add_argument("--timeout", default="300s", help="per request, whole (default: 300s)")
    parser.add_argument(
        "--extra-body",
        metavar="JSON",
        help="merged into every request, e.g. '{\"ignore_eos\": true}'",
    )
    parser.add_argument(
        "--http-client",
        choices=HTTP_CLIENTS,
        default="raw",
        help="raw: HTTP/1.1 on asyncio+httptools, cheapest per event (default); "
        "httpx: honours proxy settings in the environment",
    )
    parser.add_argument("--seed", type=int, default=0, help="synthetic prompt seed (default: 0)")
    parser.add_argument("--json", metavar="FILE", help="write all results as JSON")
    parser.add_argument("--plot", metavar="FILE", help="draw tokens/s and TTFT (needs [plot])")
    parser.add_argument(
        "--progress", action="store_true", help="live progress line even when not a terminal"
    )


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Resolve the parsed flags into a checked config; raises BenchError."""
    chat_completions_url(args.base_url)
    return BenchConfig(
        base_url=args.base_url,
        model=args.model,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None,
        concurrency=parse_concurrency(args.concurrency),
        requests=args.requests,
        duration_s=None if args.duration is None else parse_duration_s(args.duration),
        stream=args.stream,
        input_tokens=args.input_tokens,
        max_tokens=args.max_tokens,
        prompt_file=args.prompt_file,
        tokenizer=args.tokenizer,
        timeout_s=parse_duration_s(args.timeout),
        seed=args.seed,
        http_client=args.http_client,
        extra_body={} if args.extra_body is None else parse_extra_body(args.extra_body),
    )


async def run(
    config: BenchConfig,
    workload: Workload,
    results: list[LevelResult],
    *,
    on_progress: Callable[[LevelProgress], None] | None = None,
    on_level: Callable[[LevelResult], None] | None = None,
) -> list[LevelResult]:
    """Every level in order through one shared client; appends to `results` as levels finish."""
    transport = open_transport(config, max(config.concurrency))
    try:
        first_request = 0
        for concurrency in config.concurrency:
            result = await run_level(
                config,
                concurrency,
                workload=workload,
                transport=transport,
                on_progress=on_progress,
                first_request=first_request,
            )
            first_request += result.requests
            results.append(result)
            if on_level is not None:
                on_level(result)
    finally:
        await transport.aclose()
    return results


def main(args: argparse.Namespace) -> int:
    """Run the bench; 0 if every level had a successful request, 1 if not, 2 for bad input,
    130 (proxy/exitstatus.py) if Ctrl-C stopped it: the levels done are shown and written; 141
    if the reader of its status lines went away (`2>&1 | head -1`): the run went on, written."""
    err = StatusLines(sys.stderr)
    try:
        config = config_from_args(args)
        check_output_paths(args.json, args.plot)  # before the run, not after an hour of it
        tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer else None
        workload = build_workload(config, tokenizer)
    except BenchError as exc:
        print(f"tokenweir bench: {exc}", file=err)
        return USAGE
    print(f"bench {chat_completions_url(config.base_url)} model={config.model}", file=err)
    print(f"prompts: {workload.prompt_note}", file=err)
    line = ProgressLine(err) if args.progress or sys.stderr.isatty() else None
    results: list[LevelResult] = []
    stopped: int | None = None  # the exit status of a run Ctrl-C or SIGTERM ended
    # SIGTERM (`timeout 10m tokenweir bench ...`) ends the run as Ctrl-C does: it killed the
    # process at once, printing and writing nothing of the levels done.
    # Only a main thread may set it (a caller running `main` in a thread keeps its own).
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if on_main else None
    try:
        _run_loop(run(config, workload, results, on_progress=line, on_level=_level_done(line, err)))
    except KeyboardInterrupt as exc:
        stopped = TERMINATED if isinstance(exc, _Terminated) else INTERRUPTED
        done = f"{len(results)} of {len(config.concurrency)} levels done"
        how = "terminated" if stopped == TERMINATED else "interrupted"
        print(f"\n{how} ({done}; the level under way is left out)", file=err)
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, previous)
    # The files first: a reader of stdout that went away (`| head -1`) must not cost them.
    problem = _write_files(args, config, workload, results, interrupted=stopped is not None)
    if results:
        print(format_table(results))
    if problem is not None:
        print(f"tokenweir bench: {problem}", file=err)
        return USAGE
    if stopped is not None:
        return stopped
    if err.gone:
        return READER_GONE
    return 0 if results and all(level.ok > 0 for level in results) else 1


def _write_files(
    args: argparse.Namespace,
    config: BenchConfig,
    workload: Workload,
    results: list[LevelResult],
    *,
    interrupted: bool,
) -> str | None:
    """Write --json and --plot; why one could not be written, if so."""
    try:
        if args.json:
            document = result_document(config, workload, results, interrupted=interrupted)
            write_json(args.json, document)
        if args.plot and results:
            write_plot(args.plot, results, f"{config.model} at {config.base_url}")
    except BenchError as exc:
        return str(exc)
    return None


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the run is, as SIGINT raises KeyboardInterrupt."""


def _terminated(signum: int, frame: object) -> None:
    raise _Terminated


def _level_done(line: ProgressLine | None, err: StatusLines) -> Callable[[LevelResult], None]:
    def done(level: LevelResult) -> None:
        if line is not None:
            line.end()
        print(level_line(level), file=err)

    return done


def _run_loop(coroutine: Coroutine[Any, Any, object]) -> None:
    """Run on uvloop where installed: its lower per-event cost keeps the client off the limit."""
    try:
        import uvloop  # optional: not installed on Windows
    except ImportError:
        runloop.run(coroutine)
    else:
        runloop.run(coroutine, loop_factory=uvloop.new_event_loop)
