"""Semantic cache precision: labelled question pairs replayed through the real cache, by threshold.

    python benchmarks/semantic_cache.py [--repeats 3] [--data FILE]
    python benchmarks/semantic_cache.py --engines
        [--vector-search auto|redis|redis-search|redis-vsets|local]
        [--redis-url URL] [--sizes 10000,100000] [--ef-runtime 10,64,128,256] [--data FILE]

`--data`: labelled pairs in qqp_dev.jsonl's format (default: that file). `--engines`: lookup
latency and neighbour quality per engine (semantic_engines.py); `--vector-search local` without
`--redis-url` is the memory store's mirror, the others need a URL of a Redis with RediSearch
(`auto`, `redis`, `redis-search`: FT.SEARCH) or Redis 8 (`redis-vsets`: vector sets).

Needs ../shared/data/semcache (evaluation data, never copied here) and the local-embed extra.
Every question gets a real cache key (one tenant, one model, one system prompt, temperature 0,
mode semantic) and its normalised text a LocalEmbedder vector; entries go into a
MemoryCacheStore and queries through SemanticIndex.nearest, with the guards on or off.
Protocols (the data's README): QQP cache replay and pairwise cosine on qqp_dev; GPTCache's
(cache every `origin`, query every `similar` plus as many unrelated QQP questions as must-miss
traffic). Vectors are kept in /tmp between runs. Results: benchmarks/results/semantic_cache.*
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from harness import RESULTS
from semantic_engines import engine_rows
from semantic_engines import markdown as engine_markdown
from semantic_report import choose_default, markdown

import proxy.cache.semantic
from proxy.cache.embed import normalise
from proxy.cache.embed_local import LocalEmbedder
from proxy.cache.guards import GUARDS, Guard, guarded_by
from proxy.cache.key import cache_key
from proxy.cache.semantic import SemanticIndex
from proxy.cache.vectors import pack
from proxy.policy.model import CacheSpec
from proxy.storage.cache import CacheEntry
from proxy.storage.memory.cache import MemoryCacheStore

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "semcache"
VECTORS = Path(tempfile.gettempdir()) / "tokenweir-semcache-vectors.npz"
THRESHOLDS = [round(0.70 + 0.01 * i, 2) for i in range(29)]
TENANT, MODEL, SYSTEM = "bench", "mock-llm", "You are a helpful assistant. Answer briefly."
SPEC = CacheSpec(mode="semantic")
Vectors = dict[str, np.ndarray]
Found = list[tuple[str | None, float]]  # per query: the matched cached question and similarity


@dataclass(frozen=True)
class Protocol:
    """Questions to cache, queries to ask, and which cached questions may answer each query."""

    cached: list[str]
    queries: list[str]
    answers: list[frozenset[str]]


def qqp_rows(path: Path = DATA / "qqp_dev.jsonl") -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines]


def qqp_replay(rows: list[dict[str, Any]], *, classes: bool = False) -> Protocol:
    """Every distinct text_a cached; every text_b not itself cached asked.

    A cached question answers a query it is labelled a duplicate of; with `classes`, also one
    that is a duplicate of a duplicate (labels closed transitively: QQP labels are incomplete).
    """
    cached = list(dict.fromkeys(row["text_a"] for row in rows))
    seen = {normalise(text) for text in cached}
    queries = [q for q in dict.fromkeys(row["text_b"] for row in rows) if normalise(q) not in seen]
    duplicates = _duplicates(rows, classes=classes)
    answers = [frozenset(duplicates.get(q, set()) & set(cached)) for q in queries]
    return Protocol(cached, queries, answers)


def _duplicates(rows: list[dict[str, Any]], *, classes: bool) -> dict[str, set[str]]:
    """Each question's labelled duplicates (with `classes`, its whole duplicate class)."""
    duplicates: dict[str, set[str]] = {}
    for row in rows:
        if row["label"] == 1:
            a, b = row["text_a"], row["text_b"]
            if classes:
                merged = duplicates.get(a, {a}) | duplicates.get(b, {b})
                duplicates.update(dict.fromkeys(merged, merged))
            else:
                duplicates.setdefault(a, set()).add(b)
                duplicates.setdefault(b, set()).add(a)
    return duplicates


def gptcache(rows: list[dict[str, Any]]) -> Protocol:
    pairs = json.loads((DATA / "gptcache_mock_data.json").read_text(encoding="utf-8"))
    cached = list(dict.fromkeys(pair["origin"] for pair in pairs))
    unrelated = list(dict.fromkeys(row["text_a"] for row in rows))[: len(pairs)]
    queries = [pair["similar"] for pair in pairs] + unrelated
    answers = [frozenset([pair["origin"]]) for pair in pairs] + [frozenset()] * len(unrelated)
    return Protocol(cached, queries, answers)


def load_vectors(embedder: LocalEmbedder, texts: Sequence[str]) -> Vectors:
    """Vectors of the normalised texts, from /tmp when an earlier run embedded them."""
    known: Vectors = {}
    if VECTORS.exists():
        stored = np.load(VECTORS, allow_pickle=False)
        known = dict(zip(stored["texts"].tolist(), stored["vectors"], strict=True))
    missing = sorted({normalise(t) for t in texts} - known.keys())
    if missing:
        print(f"embedding {len(missing)} questions", file=sys.stderr, flush=True)
        known.update(zip(missing, embedder.embed_many(missing), strict=True))
        names = sorted(known)
        np.savez(VECTORS, texts=np.array(names), vectors=np.stack([known[n] for n in names]))
    return known


def body(question: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {"model": MODEL, "messages": messages, "temperature": 0}


@contextmanager
def guards(guard: Guard) -> Iterator[None]:
    """SemanticIndex's guard swapped for `guard` (the benchmark's only way to turn guards off)."""
    original = proxy.cache.semantic.compatible
    proxy.cache.semantic.compatible = guard
    try:
        yield
    finally:
        proxy.cache.semantic.compatible = original


def keyed(question: str) -> tuple[str, str]:
    """(exact key, partition) of a semantic-mode chat request asking `question`."""
    key = cache_key(TENANT, MODEL, "chat", body(question), SPEC)
    if key is None or key.partition is None or key.question != question:
        raise SystemExit("the benchmark's request is not semantically cacheable")
    return key.exact, key.partition


async def replay(protocol: Protocol, vectors: Vectors, threshold: float) -> Found:
    """Cache, then ask: one nearest() per query, through a fresh store and index."""
    store, asked = MemoryCacheStore(), {}
    for question in protocol.cached:
        exact, partition = keyed(question)
        vector = pack(vectors[normalise(question)], question)
        await store.put(
            CacheEntry(TENANT, exact, b"answer-id", 0.0, 3600.0, 10**6, partition, vector)
        )
        asked[exact] = question
    index, found = SemanticIndex(store), []
    for question in protocol.queries:
        _, partition = keyed(question)
        vector = vectors[normalise(question)]
        match = await index.nearest(TENANT, partition, vector, question, threshold)
        found.append((None, 0.0) if match is None else (asked[match.key], match.similarity))
    return found


def replay_curve(protocol: Protocol, found: Found) -> list[dict[str, float]]:
    """By threshold: a lookup at a higher threshold returns the same match if it clears it.

    (nearest() walks its candidates best first and stops below the threshold, so one lookup at
    the lowest threshold answers for all; `check_equivalence` verifies this.)
    """
    answerable = sum(1 for a in protocol.answers if a)
    unanswerable = len(protocol.answers) - answerable
    curve = []
    for t in THRESHOLDS:
        hits = [(m, a) for (m, s), a in zip(found, protocol.answers, strict=True) if m and s >= t]
        correct = sum(1 for m, a in hits if m in a)
        false_on_unanswerable = sum(1 for m, a in hits if not a)
        curve.append(rates(t, len(hits), correct, answerable, false_on_unanswerable, unanswerable))
    return curve


def pairwise_curve(rows: list[dict[str, Any]], vectors: Vectors, guard: Guard) -> list[Any]:
    """README protocol 1: cosine(text_a, text_b) >= t and the guard passes => hit."""
    sims = [float(vectors[normalise(r["text_a"])] @ vectors[normalise(r["text_b"])]) for r in rows]
    passes = [guard(r["text_b"], r["text_a"]) for r in rows]
    positives = sum(r["label"] for r in rows)
    curve = []
    for t in THRESHOLDS:
        hit = [r["label"] for r, s, ok in zip(rows, sims, passes, strict=True) if ok and s >= t]
        fp = len(hit) - sum(hit)
        curve.append(rates(t, len(hit), sum(hit), positives, fp, len(rows) - positives))
    return curve


def rates(t: float, hits: int, correct: int, positives: int, fp: int, negatives: int) -> Any:
    return {
        "threshold": t,
        "hits": hits,
        "precision": correct / hits if hits else 1.0,
        "recall": correct / positives,
        "false_hit_rate": fp / negatives if negatives else 0.0,
    }


def gptcache_curve(protocol: Protocol, found: Found) -> list[dict[str, float]]:
    """Recall here is the hit rate on the paraphrases; false hits are must-miss hits."""
    curve = replay_curve(protocol, found)
    asked = sum(1 for a in protocol.answers if a)
    for point in curve:
        hit_on_paraphrases = sum(
            1
            for (m, s), a in zip(found, protocol.answers, strict=True)
            if a and m and s >= point["threshold"]
        )
        point["hit_rate"] = hit_on_paraphrases / asked
    return curve


def configurations() -> dict[str, Guard]:
    """No guards, all guards, each alone and all but each."""
    chosen: dict[str, Guard] = {"cosine only": guarded_by([]), "all guards": guarded_by(GUARDS)}
    for name in GUARDS:
        chosen[f"only {name}"] = guarded_by([name])
        chosen[f"all but {name}"] = guarded_by(g for g in GUARDS if g != name)
    return chosen


async def measure(rows: list[dict[str, Any]], vectors: Vectors) -> dict[str, Any]:
    qqp, classes, gpt = qqp_replay(rows), qqp_replay(rows, classes=True), gptcache(rows)
    results: dict[str, Any] = {}
    for name, guard in configurations().items():
        with guards(guard):
            qqp_found = await replay(qqp, vectors, THRESHOLDS[0])
            gpt_found = await replay(gpt, vectors, THRESHOLDS[0])
        results[name] = {
            "qqp_replay": replay_curve(qqp, qqp_found),
            "qqp_replay_classes": replay_curve(classes, qqp_found),
            "qqp_pairwise": pairwise_curve(rows, vectors, guard),
            "gptcache": gptcache_curve(gpt, gpt_found),
        }
    await check_equivalence(qqp, vectors, results["all guards"]["qqp_replay"])
    sizes = {"qqp_cached": len(qqp.cached), "qqp_queries": len(qqp.queries)}
    sizes |= {"qqp_answerable": sum(1 for a in qqp.answers if a), "qqp_pairs": len(rows)}
    sizes |= {"gptcache_cached": len(gpt.cached), "gptcache_queries": len(gpt.queries)}
    return {"sizes": sizes, "curves": results}


async def check_equivalence(protocol: Protocol, vectors: Vectors, curve: list[Any]) -> None:
    """A real lookup at 0.90 agrees with the curve derived from the lookups at the lowest one."""
    found = await replay(protocol, vectors, 0.90)
    derived = next(p for p in curve if p["threshold"] == 0.90)
    assert sum(1 for m, _ in found if m) == derived["hits"], "threshold derivation is wrong"


def embedding_ms(embedder: LocalEmbedder, texts: Sequence[str], repeats: int) -> float:
    """Median over repeats of the mean time of one embed_many([text]) call, on one core."""
    sample = list(texts[:200])
    embedder.embed_many(sample[:5])
    means = []
    for _ in range(repeats):
        began = time.perf_counter()
        for text in sample:
            embedder.embed_many([text])
        means.append((time.perf_counter() - began) * 1000 / len(sample))
    return statistics.median(means)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data", type=Path, default=DATA / "qqp_dev.jsonl")
    parser.add_argument("--engines", action="store_true")
    parser.add_argument(
        "--vector-search",
        choices=["auto", "redis", "redis-search", "redis-vsets", "local"],
        default="auto",
    )
    parser.add_argument("--redis-url")
    parser.add_argument("--sizes", default="10000,100000")
    parser.add_argument("--ef-runtime", default="10,64,128,256")
    args = parser.parse_args()
    rows = qqp_rows(args.data)
    if args.engines:
        return engines(args, rows)
    gpt = gptcache(rows)
    texts = [t for r in rows for t in (r["text_a"], r["text_b"])] + gpt.cached + gpt.queries
    embedder = LocalEmbedder(threads=1)
    vectors = load_vectors(embedder, texts)
    report = asyncio.run(measure(rows, vectors))
    report["embedding_ms_one_core"] = embedding_ms(
        embedder, [r["text_b"] for r in rows], args.repeats
    )
    report["default"] = choose_default(report["curves"]["all guards"])
    report["guards"] = list(GUARDS)
    report["run"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    (RESULTS / "semantic_cache.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "semantic_cache.md").write_text(markdown(report, THRESHOLDS), encoding="utf-8")
    print((RESULTS / "semantic_cache.md").read_text(encoding="utf-8"))
    return 0


def engine_inputs(rows: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """The labelled duplicates' vectors: each distinct `text_a` (cached), each `text_b` (asked),
    and for each question the row of its own `text_a`."""
    pairs = [r for r in rows if r["label"] == 1]
    embedder = LocalEmbedder(threads=1)
    vectors = load_vectors(embedder, [t for r in pairs for t in (r["text_a"], r["text_b"])])
    cached_texts = list(dict.fromkeys(normalise(r["text_a"]) for r in pairs))
    position = {text: n for n, text in enumerate(cached_texts)}
    cached = np.stack([vectors[t] for t in cached_texts])
    queries = np.stack([vectors[normalise(r["text_b"])] for r in pairs])
    return cached, queries, [position[normalise(r["text_a"])] for r in pairs]


def engines(args: argparse.Namespace, rows: list[dict[str, Any]]) -> int:
    cached, queries, truth = engine_inputs(rows)
    sizes = [int(n) for n in args.sizes.split(",")]
    efs = [int(n) for n in args.ef_runtime.split(",")]
    table = asyncio.run(
        engine_rows(args.vector_search, args.redis_url, cached, queries, truth, sizes, efs)
    )
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    name = f"semantic_engines_{args.vector_search}{'_redis' if args.redis_url else ''}"
    (RESULTS / f"{name}.json").write_text(json.dumps(table, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(engine_markdown(table, load), encoding="utf-8")
    print(engine_markdown(table, load))
    return 0


if __name__ == "__main__":
    sys.exit(main())
