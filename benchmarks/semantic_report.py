"""The semantic cache benchmark's verdict: the default threshold it chooses, its tables."""

from __future__ import annotations

from typing import Any

QQP_PRECISION = 0.90
GPT_PRECISION, GPT_HIT_RATE = 0.95, 0.75
SHOWN = (0.80, 0.84, 0.86, 0.88, 0.90, 0.92, 0.94, 0.96, 0.98)

Curves = dict[str, list[dict[str, float]]]


def at(curve: list[dict[str, float]], threshold: float) -> dict[str, float]:
    return next(p for p in curve if abs(p["threshold"] - threshold) < 1e-9)


def choose_default(curves: Curves) -> dict[str, Any]:
    """The lowest threshold (the most hits) from which, with the guards on, QQP precision stays
    >= 0.90 both pairwise and in the replay by duplicate class; a wrong answer costs more than
    a miss, so QQP's hard negatives decide, and GPTCache's targets are reported at it."""
    qqp = [curves["qqp_pairwise"], curves["qqp_replay_classes"]]
    thresholds = [p["threshold"] for p in curves["qqp_pairwise"]]
    steady = [
        t
        for t in thresholds
        if all(at(c, u)["precision"] >= QQP_PRECISION for c in qqp for u in thresholds if u >= t)
    ]
    chosen = steady[0] if steady else thresholds[-1]
    gpt = at(curves["gptcache"], chosen)
    return {
        "threshold": chosen,
        "qqp_target_met": bool(steady),
        "gptcache_target_met": gpt["precision"] >= GPT_PRECISION
        and gpt["hit_rate"] >= GPT_HIT_RATE,
    }


def best_recall(curve: list[dict[str, float]], precision: float) -> tuple[float, float]:
    """(recall, threshold) of the highest recall at or above `precision`."""
    points = [(p["recall"], p["threshold"]) for p in curve if p["precision"] >= precision]
    return max(points) if points else (0.0, 1.0)


Column = tuple[str, str, str]  # (protocol, metric, heading)
REPLAY: tuple[Column, ...] = (
    ("qqp_replay", "precision", "P labelled"),
    ("qqp_replay_classes", "precision", "P class"),
    ("qqp_replay_classes", "recall", "R class"),
    ("qqp_replay", "false_hit_rate", "FHR"),
)
PAIRWISE: tuple[Column, ...] = (
    ("qqp_pairwise", "precision", "P"),
    ("qqp_pairwise", "recall", "R"),
    ("qqp_pairwise", "false_hit_rate", "FHR"),
)
GPTCACHE: tuple[Column, ...] = (
    ("gptcache", "precision", "P"),
    ("gptcache", "hit_rate", "HR"),
    ("gptcache", "false_hit_rate", "FHR"),
)


def _cells(curves: Curves | dict[str, Any], columns: tuple[Column, ...], t: float) -> list[str]:
    return [f"{at(curves[protocol], t)[metric]:.3f}" for protocol, metric, _ in columns]


def _table(
    report: dict[str, Any], columns: tuple[Column, ...], thresholds: list[float]
) -> list[str]:
    plain, guarded = report["curves"]["cosine only"], report["curves"]["all guards"]
    chosen = report["default"]["threshold"]
    heads = [head for _, _, head in columns]
    header = ["threshold", *(f"cosine {h}" for h in heads), *(f"guards {h}" for h in heads)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for t in thresholds:
        if t not in SHOWN and abs(t - chosen) > 1e-9:
            continue
        label = f"**{t:.2f}** (default)" if abs(t - chosen) < 1e-9 else f"{t:.2f}"
        cells = _cells(plain, columns, t) + _cells(guarded, columns, t)
        lines.append("| " + " | ".join([label, *cells]) + " |")
    return lines


def _ablation(report: dict[str, Any], chosen: float) -> list[str]:
    columns = (*REPLAY[1:3], *PAIRWISE[:2], *GPTCACHE[:2])
    lines = [
        f"Each guard at threshold {chosen:.2f}:",
        "",
        "| guards | replay P class | replay R class | pairwise P | pairwise R "
        "| GPTCache P | GPTCache HR |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, curves in report["curves"].items():
        lines.append("| " + " | ".join([name, *_cells(curves, columns, chosen)]) + " |")
    return lines


def _baselines(report: dict[str, Any]) -> list[str]:
    lines = []
    for protocol in ("qqp_pairwise", "qqp_replay", "qqp_replay_classes"):
        for config in ("cosine only", "all guards"):
            recall, t = best_recall(report["curves"][config][protocol], QQP_PRECISION)
            name = protocol.replace("_", " ").replace("qqp", "QQP").replace(" classes", " by class")
            lines.append(
                f"- {name}, {config}: best recall at precision >= 0.90 is {recall:.3f} (at {t:.2f})"
            )
    return lines


def markdown(report: dict[str, Any], thresholds: list[float]) -> str:
    sizes, chosen = report["sizes"], report["default"]
    met = {True: "met", False: "NOT met"}
    lines = [
        f"Run {report['run']}; embedder local:all-MiniLM-L6-v2 (int8 ONNX), "
        f"{report['embedding_ms_one_core']:.1f} ms per question on one core (mean of "
        "single-question calls). Guards: " + ", ".join(report["guards"]) + ".",
        "",
        f"Chosen default similarity: **{chosen['threshold']:.2f}**. QQP precision >= 0.90: "
        f"{met[chosen['qqp_target_met']]}; GPTCache precision >= 0.95 at hit rate >= 0.75: "
        f"{met[chosen['gptcache_target_met']]}.",
        "",
        f"QQP cache replay: {sizes['qqp_cached']:,} questions cached, "
        f"{sizes['qqp_queries']:,} asked, {sizes['qqp_answerable']:,} of them with a "
        "labelled duplicate in the cache. P labelled: hits on a labelled duplicate / hits; "
        "P class and R class: hits on a duplicate or a duplicate's duplicate (labels closed "
        "transitively) / hits and / answerable queries; FHR: hits on queries with no "
        "duplicate cached / such queries.",
        "",
        *_table(report, REPLAY, thresholds),
        "",
        f"QQP pairwise ({sizes['qqp_pairs']:,} labelled pairs, what model cards report): "
        "cosine(text_a, text_b) >= threshold and the guards pass => hit.",
        "",
        *_table(report, PAIRWISE, thresholds),
        "",
        *_baselines(report),
        "",
        f"GPTCache protocol: {sizes['gptcache_cached']:,} origins cached; "
        f"{sizes['gptcache_queries']:,} asked, every paraphrase plus as many unrelated "
        "QQP questions that must miss. P over all hits, HR (hit rate) on the paraphrases, "
        "FHR on the must-miss questions.",
        "",
        *_table(report, GPTCACHE, thresholds),
        "",
        *_ablation(report, chosen["threshold"]),
        "",
        *_ablation(report, 0.90),
    ]
    return "\n".join(lines) + "\n"
