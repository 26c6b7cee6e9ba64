"""Show bench results: the live progress line, the final table, the JSON file and the plot."""

from __future__ import annotations

import dataclasses
import importlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import orjson

from proxy.tools.bench.client import USAGE
from proxy.tools.bench.config import BenchConfig, BenchError
from proxy.tools.bench.level import LevelProgress, LevelResult
from proxy.tools.bench.prompts import Workload
from proxy.tools.textout import StatusLines

__all__ = [
    "CPU_WARNING_FRACTION",
    "ProgressLine",
    "check_output_paths",
    "config_json",
    "format_table",
    "level_json",
    "level_line",
    "result_document",
    "write_json",
    "write_plot",
]

# Above this share of one core the client, not the server, may be what limits the numbers.
CPU_WARNING_FRACTION = 0.8


class ProgressLine:
    """Rewrites one status line on a terminal; the level runner calls it a few times a second."""

    __slots__ = ("_stream", "_width")

    def __init__(self, stream: TextIO | StatusLines) -> None:
        self._stream = stream
        self._width = 0

    def __call__(self, progress: LevelProgress) -> None:
        elapsed_s = time.perf_counter() - progress.start_s
        planned = "" if progress.planned is None else f"/{progress.planned}"
        rate = progress.output_tokens / elapsed_s if elapsed_s > 0 else 0.0
        tokens = "tokens not counted" if progress.uncounted else f"{rate:.0f} tok/s"
        line = (
            f"concurrency {progress.concurrency}: {progress.finished}{planned} done, "
            f"{progress.failed} failed, {progress.started - progress.finished} in flight, "
            f"{elapsed_s:.1f} s, {tokens}"
        )
        self._stream.write("\r" + line.ljust(self._width))
        self._stream.flush()
        self._width = len(line)

    def end(self) -> None:
        if self._width:
            self._stream.write("\n")
            self._stream.flush()
        self._width = 0


def _num(value: float | None, scale: float = 1.0, digits: int = 0) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


_HEADER = (
    "conc",
    "ok/err",
    "req/s",
    "TTFT p50/p90/p99 ms",
    "ITL p50/p99 ms",
    "stream tok/s mean/p10",
    "total tok/s",
    "e2e p50/p99 s",
    "CPU",
)


def _row(level: LevelResult) -> tuple[str, ...]:
    ttft, itl, speed, e2e = level.ttft_s, level.itl_s, level.stream_tokens_per_s, level.e2e_s
    return (
        str(level.concurrency),
        f"{level.ok}/{level.requests - level.ok}",
        _num(level.requests_per_s, digits=2),
        "/".join(_num(v, 1000.0) for v in (ttft.p50, ttft.p90, ttft.p99)),
        "/".join(_num(v, 1000.0, 1) for v in (itl.p50, itl.p99)),
        "/".join(_num(v, digits=1) for v in (speed.mean, speed.p10)),
        _num(level.aggregate_tokens_per_s, digits=1),
        "/".join(_num(v, digits=2) for v in (e2e.p50, e2e.p99)),
        f"{level.client_cpu_fraction:.0%}",
    )


def format_table(levels: Sequence[LevelResult]) -> str:
    """The end-of-run table, then per level its verdict, errors and any client-CPU warning."""
    rows = [_HEADER, *(_row(level) for level in levels)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_HEADER))]
    lines = [
        "  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True))
        for row in rows
    ]
    for level in levels:
        lines.append(f"concurrency {level.concurrency}: median stream speed {level.verdict}")
        if level.ok and level.token_source != USAGE:  # with no answer, nothing was counted
            lines.append(f"  tokens counted from: {level.token_source}")
        for kind, count in level.errors.items():
            example = _inert(level.error_examples.get(kind, ""))
            lines.append(f"  {count} x {kind}" + (f": {example}" if example else ""))
        if level.client_cpu_fraction > CPU_WARNING_FRACTION:
            lines.append(
                f"  warning: the bench client used {level.client_cpu_fraction:.0%} of a CPU core;"
                " these numbers may be the client's limit, not the server's"
            )
    return "\n".join(lines)


def _inert(text: str) -> str:
    """An endpoint's words as one line that cannot move the cursor or restyle the terminal:
    control characters (newlines, escape sequences) and invisible format ones shown escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def level_line(level: LevelResult) -> str:
    """The one line printed as each level ends."""
    total = level.aggregate_tokens_per_s
    tokens = "tokens not counted" if total is None else f"{total:.0f} tok/s total"
    counts = f"{level.ok} ok, {level.requests - level.ok} failed in {level.wall_s:.1f} s"
    return f"concurrency {level.concurrency}: {counts}, {tokens}"


def config_json(config: BenchConfig) -> dict[str, Any]:
    """A config as plain JSON types; the API key itself is never included."""
    settings = dataclasses.asdict(config)
    settings["api_key"] = "set" if config.api_key else None
    return settings


def level_json(level: LevelResult) -> dict[str, Any]:
    """A level's result as plain JSON types (seconds, tokens/s; summaries as nested objects)."""
    return dataclasses.asdict(level)


def result_document(
    config: BenchConfig,
    workload: Workload,
    levels: Sequence[LevelResult],
    *,
    interrupted: bool = False,
) -> dict[str, Any]:
    """Everything a run measured, for `--json`; `interrupted`: Ctrl-C stopped it, and `levels`
    holds those done before (not every level of `config`)."""
    return {
        "tool": "tokenweir bench",
        "interrupted": interrupted,
        "config": config_json(config),
        "workload": {
            "prompts": workload.prompt_note,
            "tokenizer": None if workload.tokenizer is None else workload.tokenizer.name,
        },
        "levels": [level_json(level) for level in levels],
    }


def check_output_paths(json_path: str | None, plot_path: str | None) -> None:
    """Refuse a --json or --plot file that could not be written, before the run it would end."""
    for flag, path in (("--json", json_path), ("--plot", plot_path)):
        if path is None:
            continue
        target = Path(path)
        if target.is_dir():
            raise BenchError(f"{flag} {path} is a directory: give a file name")
        if not target.absolute().parent.is_dir():
            raise BenchError(f"{flag} {path}: there is no directory {target.absolute().parent}")


def write_json(path: str, document: dict[str, Any]) -> None:
    try:
        Path(path).write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2) + b"\n")
    except OSError as exc:
        raise BenchError(f"cannot write --json file: {exc}") from None


def write_plot(path: str, levels: Sequence[LevelResult], title: str) -> None:
    """Total tokens/s, per-stream tokens/s and TTFT against concurrency (log2 axis)."""
    try:
        figure_module = importlib.import_module("matplotlib.figure")
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install 'tokenweir[plot]'") from None
    concurrency = [level.concurrency for level in levels]
    figure = figure_module.Figure(figsize=(14, 4.5), layout="constrained")
    total_axes, stream_axes, ttft_axes = figure.subplots(1, 3)
    total_axes.plot(concurrency, [_nan(lv.aggregate_tokens_per_s) for lv in levels], "o-")
    total_axes.set(ylabel="output tokens/s", title="Total throughput")
    for name, pick in (("p50", 0), ("p10", 1)):
        speeds = [(lv.stream_tokens_per_s.p50, lv.stream_tokens_per_s.p10)[pick] for lv in levels]
        stream_axes.plot(concurrency, [_nan(v) for v in speeds], "o-", label=name)
    stream_axes.set(ylabel="tokens/s after the first", title="Per-stream speed")
    for name, pick in (("p50", 0), ("p90", 1), ("p99", 2)):
        values = [(lv.ttft_s.p50, lv.ttft_s.p90, lv.ttft_s.p99)[pick] for lv in levels]
        ttft_axes.plot(concurrency, [_nan(v, 1000.0) for v in values], "o-", label=name)
    ttft_axes.set(ylabel="ms", title="Time to first token")
    for axes in (total_axes, stream_axes, ttft_axes):
        axes.set_xscale("log", base=2)
        axes.set(
            xlabel="concurrency", xticks=concurrency, xticklabels=[str(c) for c in concurrency]
        )
        axes.set_ylim(bottom=0)
        axes.grid(visible=True, alpha=0.3)
    stream_axes.legend()
    ttft_axes.legend()
    figure.suptitle(title)
    try:
        figure.savefig(path, dpi=110)
    except OSError as exc:
        raise BenchError(f"cannot write --plot file: {exc}") from None


def _nan(value: float | None, scale: float = 1.0) -> float:
    return float("nan") if value is None else value * scale
