"""Budget stages' cost: the same load through a gateway without and with budgets, in one run.

    python benchmarks/budgets.py [--repeats 3]

1. Latency: non-stream requests with a ~2,000-token prompt, one at a time, through a plain
   gateway and through one whose tenant has a full budget card (Qwen2.5 tokenizer from
   ../shared, input limit, output clamp, system prompt, temperature, daily token and USD quotas).
   Reported: end-to-end p50/p90 of each and the difference.
2. Stalls: 16 streams at 750 tokens/s through each gateway while another client sends a
   100k-token prompt every 250 ms to the same gateway. Only the budget gateway counts them (off
   the event loop); reported is the streams' inter-token latency p99 with and without counting.
Results: benchmarks/results/budgets.{json,md}.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import httpx
from harness import KEY, Process, Samples, bench, policy_for, publish, started, warm_up

QWEN = (
    Path(__file__).resolve().parents[2]
    / "shared"
    / "data"
    / "tokenizers"
    / "qwen2.5"
    / "qwen.tiktoken"
)
# tiktoken looks a named encoding up in TIKTOKEN_CACHE_DIR under the sha1 of its download URL.
O200K = QWEN.parents[1] / "o200k_base.tiktoken"
O200K_URL = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"


def offline_o200k(directory: Path) -> str:
    """`tiktoken:o200k_base`, loadable without a download: ../shared's file linked into
    `directory` under tiktoken's cache name, and TIKTOKEN_CACHE_DIR set to `directory` for this
    process and every gateway it starts after."""
    cached = directory / hashlib.sha1(O200K_URL.encode(), usedforsecurity=False).hexdigest()
    if not cached.exists():
        cached.symlink_to(O200K)
    os.environ["TIKTOKEN_CACHE_DIR"] = str(directory)
    return "tiktoken:o200k_base"


FULL_BUDGET = (
    "{system_prompt: You are a helpful assistant., max_input_tokens: 1000000, "
    "max_output_tokens: 4096, temperature: 0.3, tokens_per_day: 100000000000, "
    "usd_per_day: 10000000}"
)


def latency(plain: Process, budgeted: Process, repeats: int) -> dict[str, float | None]:
    samples = Samples()
    for _ in range(repeats):
        for name, gateway in (("plain", plain), ("budget", budgeted)):
            level = bench(gateway.url, 1, 200, stream=False, tokens=16, input_tokens=2000)
            samples.add(f"{name}_p50", level["e2e_s"]["p50"])
            samples.add(f"{name}_p90", level["e2e_s"]["p90"])
        samples.add(
            "added_p50", _diff(samples.values["budget_p50"][-1], samples.values["plain_p50"][-1])
        )
    return {name: samples.median(name) for name in samples.values}


BIG_PROMPT_INTERVAL_S = 0.25


def big_prompts(url: str, stop: threading.Event, sent: list[int]) -> None:
    """A 100k-token prompt every 250 ms (the same load on both gateways) until told to stop."""
    prompt = " ".join(f"w{i % 5000}" for i in range(100_000))
    body = {"model": "mock-llm", "max_tokens": 1, "messages": [{"role": "user", "content": prompt}]}
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {KEY}"}, timeout=60) as http:
        while not stop.wait(BIG_PROMPT_INTERVAL_S):
            http.post("/v1/chat/completions", json=body).raise_for_status()
            sent.append(1)


def stalls(plain: Process, budgeted: Process, repeats: int) -> dict[str, float | None]:
    samples = Samples()
    for _ in range(repeats):
        for name, gateway in (("plain", plain), ("budget", budgeted)):
            stop, sent = threading.Event(), []
            loader = threading.Thread(target=big_prompts, args=(gateway.url, stop, sent))
            loader.start()
            try:
                level = bench(gateway.url, 16, 160, stream=True, tokens=256)
            finally:
                stop.set()
                loader.join()
            samples.add(f"{name}_itl_p99", level["itl_s"]["p99"])
            samples.add(f"{name}_itl_p50", level["itl_s"]["p50"])
            samples.add(f"{name}_big_prompts", float(len(sent)))
    result = {name: samples.median(name) for name in samples.values}
    result["added_itl_p99"] = _diff(result.get("budget_itl_p99"), result.get("plain_itl_p99"))
    return result


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def markdown(report: dict[str, Any]) -> str:
    lat, stall = report["latency"], report["stalls"]

    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value * 1000:.2f}"

    return "\n".join([
        f"Run {report['when']}, {report['repeats']} repeats, medians.",
        "",
        "| ~2,000-token prompt, non-stream, one at a time | plain gateway | with budgets | added |",
        "|---|---:|---:|---:|",
        f"| end-to-end p50 ms | {ms(lat.get('plain_p50'))} | {ms(lat.get('budget_p50'))} "
        f"| {ms(lat.get('added_p50'))} |",
        f"| end-to-end p90 ms | {ms(lat.get('plain_p90'))} | {ms(lat.get('budget_p90'))} | |",
        "",
        "| 16 streams at 750 tok/s, 100k-token prompts arriving meanwhile | plain gateway "
        "| counting gateway | added |",
        "|---|---:|---:|---:|",
        f"| ITL p50 ms | {ms(stall.get('plain_itl_p50'))} | {ms(stall.get('budget_itl_p50'))} | |",
        f"| ITL p99 ms | {ms(stall.get('plain_itl_p99'))} | {ms(stall.get('budget_itl_p99'))} "
        f"| {ms(stall.get('added_itl_p99'))} |",
        f"| 100k-token prompts served during the run | {stall.get('plain_big_prompts')} "
        f"| {stall.get('budget_big_prompts')} | |",
    ]) + "\n"  # fmt: skip


@contextmanager
def gateways(tokens_per_second: str, work: Path) -> Iterator[tuple[Process, Process]]:
    """A simulated backend with two warmed gateways before it: plain, and with budgets."""
    mock_args = ["mock-backend", "--tokens-per-second", tokens_per_second]
    with started(mock_args, "/v1/models", work / f"mock-{tokens_per_second}.log") as mock:
        plain_cfg = policy_for(mock.url, work, name="plain")
        budget_cfg = policy_for(
            mock.url, work, name="budget", tokenizer=str(QWEN), budget=FULL_BUDGET
        )
        with (
            started(["serve", "--config", str(plain_cfg)], "/healthz", work / "g1.log") as plain,
            started(
                ["serve", "--config", str(budget_cfg)], "/healthz", work / "g2.log"
            ) as budgeted,
        ):
            warm_up(plain, budgeted)
            yield plain, budgeted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not QWEN.exists():
        print(f"needs the Qwen tokenizer file at {QWEN} (../shared)", file=sys.stderr)
        return 2
    report: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "repeats": args.repeats,
    }  # fmt: skip
    with TemporaryDirectory() as tmp:
        with gateways("inf", Path(tmp)) as (plain, budgeted):
            print("latency ...", file=sys.stderr, flush=True)
            report["latency"] = latency(plain, budgeted, args.repeats)
        with gateways("750", Path(tmp)) as (plain, budgeted):
            print("stalls ...", file=sys.stderr, flush=True)
            report["stalls"] = stalls(plain, budgeted, args.repeats)
    publish("budgets", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
