"""Selection benchmark (docs/algorithms.md §4), side by side with the `uniform` baseline in one run.

Setup: cached embeddings for --pool prompts (default 200,000; 384-wide, the MiniLM width, drawn around 256
topic centres so the pool has real cluster structure), with EPS scores for half of them (higher in some
topics, as in a real pool where some skills are half-learnt and others saturated).
- kmeans selection of a batch of --batch (default 1,024): wall time, median of --repeats (target < 10 s);
- against `uniform` on the same pool: cluster entropy of the batch over the selection's k-means clusters
  (and, as a cross-check, over an independent k-means clustering), and the batch's mean EPS (unscored
  prompts count as the scored mean); kmeans should be higher on both;
- MiniLM embedding throughput of the packaged all-MiniLM-L6-v2 on real prompt texts, texts/s.

--json PATH writes the figures as flat keys: select_kmeans_s (and its min and max over the repeats),
entropy_own_<arm>, entropy_independent_<arm>, mean_eps_<arm> for arm uniform and kmeans, embed_texts_per_s.

    python benchmarks/select.py [--pool 200000] [--batch 1024] [--repeats 3] [--texts 512] [--json PATH]
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run as a script, this file's folder would shadow the standard library's `select`

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from tasks.core.selection import cluster_entropy, kmeans, n_clusters, select_kmeans, select_uniform  # noqa: E402


def synthetic_pool(n: int, dim: int = 384, topics: int = 256, seed: int = 0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(topics, dim)).astype(np.float32)
    topic = rng.integers(0, topics, size=n)
    x = centres[topic] + 0.6 * rng.normal(size=(n, dim)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    gap = rng.beta(0.6, 2.0, size=topics) * 0.45  # most topics low-gap, a few with much left to learn
    eps = np.clip(gap[topic] + rng.normal(0, 0.03, n), 0, None)
    eps[rng.random(n) < 0.5] = np.nan  # half never scored
    return [f"p{i:06d}" for i in range(n)], x, eps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--texts", type=int, default=512)
    ap.add_argument("--json", default=None, metavar="PATH", help="write the figures as flat keys")
    a = ap.parse_args()
    ids, x, eps = synthetic_pool(a.pool)
    print(f"pool {a.pool:,} prompts x {x.shape[1]} dims, {np.isnan(eps).mean():.0%} unscored; batch {a.batch}; "
          f"K = {n_clusters(a.pool)}")

    times, rows = [], None
    for r in range(a.repeats):
        t0 = time.perf_counter()
        rows, cents = select_kmeans(ids, x, eps, a.batch, seed=r)
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    print(f"kmeans select: {t:.2f} s median of {a.repeats} (target < 10 s: {'ok' if t < 10 else 'MISS'})")
    figures = {"select_kmeans_s": t, "select_kmeans_s_min": min(times), "select_kmeans_s_max": max(times)}

    pos = {p: i for i, p in enumerate(ids)}
    filled = np.where(np.isnan(eps), np.nanmean(eps), eps)
    uni = select_uniform(ids, a.batch, seed=0)
    centres = np.asarray(cents["vector"].to_list(), np.float32)
    own = np.argmax(x @ centres.T - 0.5 * (centres * centres).sum(1), axis=1)  # the selection's clusters
    other, _ = kmeans(x, n_clusters(a.pool), seed=123)  # an independent clustering, as a cross-check
    print(f"{'':<20} {'entropy, its clusters':>22} {'entropy, independent':>21} {'mean EPS':>9}")
    for name, sel in (("uniform (baseline)", uni), ("kmeans", rows)):
        idx = np.array([pos[p] for p in sel["prompt_id"]])
        arm = name.split()[0]
        figures |= {f"entropy_own_{arm}": cluster_entropy(own[idx]), f"entropy_independent_{arm}":
                    cluster_entropy(other[idx]), f"mean_eps_{arm}": float(filled[idx].mean())}
        print(f"{name:<20} {figures[f'entropy_own_{arm}']:>22.3f} {figures[f'entropy_independent_{arm}']:>21.3f} "
              f"{figures[f'mean_eps_{arm}']:>9.4f}")

    from tasks.ingest import load_source
    from tasks.selectors.embed import embed_minilm

    texts = [r.text for r in load_source("rg:basic_arithmetic", a.texts, 0, {})[0]]
    embed_minilm(texts[:8])  # load the model outside the timing
    t0 = time.perf_counter()
    embed_minilm(texts)
    dt = time.perf_counter() - t0
    print(f"MiniLM embedding: {len(texts) / dt:.0f} texts/s ({len(texts)} reasoning-gym prompts)")
    figures["embed_texts_per_s"] = len(texts) / dt
    if a.json:
        Path(a.json).write_text(json.dumps({k: float(v) for k, v in figures.items()}, indent=1, sort_keys=True))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
