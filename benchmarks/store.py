"""Store benchmark: append throughput and per-prompt group statistics, each against a named baseline.

Data: N synthetic rollouts (default 1,000,000) with ~200-character completions, over 5,000 prompts and
10 rounds; all measured side by side in one process, medians over --repeats.

1. Append: `Store.commit`, one stage per round (atomic, with commit records), against a raw
   `pyarrow.parquet.write_to_dataset` of the same table partitioned by run_id and round, with the same
   compression. Ratio = store throughput / raw throughput. Target >= 0.8.
2. Group statistics per (round, prompt_id): n, mean, population std of the reward, over the whole store,
   via the DuckDB views and via polars lazy frames, against a naive pure-Python dict loop over the rows
   (reading included in every case). Target >= 50x faster and under 1 s on 2 cores. Two naive loops are
   printed: A reads the full rows (the literal baseline), B reads only the three columns it needs.

--json PATH writes the figures as flat keys: append_raw_s, append_store_s, append_ratio (raw / store time),
groups_naive_full_s, groups_naive_columns_s, and groups_<way>_s and groups_<way>_speedup (against naive loop
A) for <way> duckdb_open, duckdb_connect and polars.

    python benchmarks/store.py                # full size
    python benchmarks/store.py --rows 100000  # quick
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run as a script, this folder's select.py would shadow the standard library's `select`
import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from storage import query  # noqa: E402
from storage.store import Store  # noqa: E402

WORDS = ["first", "we", "compute", "the", "product", "of", "the", "two", "numbers", "then", "add", "carry", "so", "the", "result", "is", "step", "multiply", "digit", "answer", "therefore", "final", "check", "again", "because", "sum", "equals", "minus", "plus", "times", "divided", "remainder", "which", "gives", "let", "us", "think", "about", "this", "problem", "carefully", "and", "verify", "each", "partial", "value", "before", "writing", "boxed"]


def synthetic_rollouts(n: int, prompts: int = 5_000, rounds: int = 10, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    words = np.array(WORDS)
    n_words = rng.integers(28, 44, size=n)
    picks = rng.integers(0, len(words), size=int(n_words.sum()))
    nums = rng.integers(0, 10_000, size=n)
    flat = words[picks].tolist()
    completions, pos = [], 0
    for i, k in enumerate(n_words.tolist()):
        completions.append(" ".join(flat[pos : pos + k]) + f" \\boxed{{{nums[i]}}}")
        pos += k
    prompt_idx = rng.integers(0, prompts, size=n)
    reward = (rng.random(n) < 0.35).astype(np.float64)
    return pa.table({
        "run_id": pa.array(["bench"] * n),
        "round": pa.array(np.repeat(np.arange(rounds), -(-n // rounds))[:n].astype(np.int32)),
        "policy_version": pa.array(np.zeros(n, np.int32)),
        "prompt_id": pa.array([f"p{i:05d}" for i in prompt_idx]),
        "sample_idx": pa.array((np.arange(n) % 8).astype(np.int32)),
        "prompt_text": pa.array([f"Solve the following multiplication: {i % 10} * {i % 7}." for i in prompt_idx]),
        "completion": pa.array(completions),
        "reward": pa.array(reward),
        "correct": pa.array(reward == 1.0),
        "n_tokens": pa.array(n_words * 2, pa.int32()),
        "mean_logprob": pa.array(-rng.random(n)),
        "finish_reason": pa.array(["stop"] * n),
        "augmentation": pa.nulls(n, pa.string()),
    })


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def bench_append(table: pa.Table, workdir: Path, repeats: int, figures: dict) -> Store:
    rounds = sorted(set(table["round"].to_pylist()))
    slices = [table.filter(pc.equal(table["round"], r)) for r in rounds]
    counter = iter(range(10**6))

    def store_append():
        s = Store(workdir / f"store-{next(counter)}")
        for r, t in zip(rounds, slices):
            s.commit("collect", {"rollouts": t}, run_id="bench", round=r)
        return s

    def raw_append():
        pq.write_to_dataset(table, workdir / f"raw-{next(counter)}", partition_cols=["run_id", "round"],
                            compression="zstd")

    raw_t, _ = timed(raw_append, repeats)
    store_t, s = timed(store_append, repeats)
    n = table.num_rows
    print(f"append  raw write_to_dataset : {raw_t:7.2f} s  {n / raw_t:>12,.0f} rows/s   (baseline)")
    print(f"append  Store.commit         : {store_t:7.2f} s  {n / store_t:>12,.0f} rows/s   "
          f"ratio {raw_t / store_t:.2f} (target >= 0.8)")
    figures |= {"append_raw_s": raw_t, "append_store_s": store_t, "append_ratio": raw_t / store_t}
    return s


GROUP_SQL = """
SELECT round, prompt_id, count(*) AS n, avg(reward) AS mean, stddev_pop(reward) AS std
FROM rollouts GROUP BY round, prompt_id
"""


def bench_groups(store: Store, repeats: int, figures: dict) -> None:
    import polars as pl

    con = query.connect(store)

    def duck_open():  # an open connection, as in an interactive session: the query reads Parquet every time
        return con.sql(GROUP_SQL).to_arrow_table().num_rows

    def duck_cold():  # including connect: listing commit records and creating the views
        return query.connect(store).sql(GROUP_SQL).to_arrow_table().num_rows

    def polars():
        return (query.scan(store, "rollouts").group_by("round", "prompt_id")
                .agg(pl.len().alias("n"), pl.col("reward").mean().alias("mean"),
                     pl.col("reward").std(ddof=0).alias("std")).collect().height)

    def naive(columns=("round", "prompt_id", "reward")):
        """Read the rows, loop over them as dicts, two-pass mean and population std per group."""
        groups: dict = {}
        for f in store.files("rollouts"):
            for row in pq.read_table(f, columns=list(columns) if columns else None).to_pylist():
                groups.setdefault((row["round"], row["prompt_id"]), []).append(row["reward"])
        out = {}
        for key, rs in groups.items():
            n = len(rs)
            mean = sum(rs) / n
            out[key] = (n, mean, (sum((x - mean) ** 2 for x in rs) / n) ** 0.5)
        return len(out)

    naive_t, g0 = timed(naive, max(1, repeats // 2))
    naive_all_t, _ = timed(lambda: naive(None), 1)
    ways = (("DuckDB, open connection", "duckdb_open", duck_open), ("DuckDB, incl. connect  ", "duckdb_connect",
            duck_cold), ("polars lazy frame      ", "polars", polars))
    results = [(name, *timed(fn, repeats)) for name, _, fn in ways]
    figures |= {"groups_naive_full_s": naive_all_t, "groups_naive_columns_s": naive_t}
    for (_, key, _), (_, t, _) in zip(ways, results):
        figures |= {f"groups_{key}_s": t, f"groups_{key}_speedup": naive_all_t / t}
    assert all(g == g0 for _, _, g in results), (g0, results)
    print(f"groups  naive loop over full rows    : {naive_all_t:7.3f} s  ({g0:,} groups)   (baseline A)")
    print(f"groups  naive loop over 3 columns    : {naive_t:7.3f} s  (baseline B, column-pruned)")
    for name, t, _ in results:
        verdict = "ok" if t < 1.0 and naive_all_t / t >= 50 else "MISS"
        print(f"groups  {name}      : {t:7.3f} s  speed-up {naive_all_t / t:6.1f}x vs A, {naive_t / t:5.1f}x vs B"
              f"   (target >= 50x vs A and < 1 s: {verdict})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, metavar="PATH", help="write the figures as flat keys")
    a = ap.parse_args()
    figures: dict = {}
    t0 = time.perf_counter()
    table = synthetic_rollouts(a.rows)
    mean_chars = pc.mean(pc.utf8_length(table["completion"])).as_py()
    print(f"data: {table.num_rows:,} rollouts, 5,000 prompts, 10 rounds, mean completion {mean_chars:.0f} chars "
          f"({table.nbytes / 2**20:.0f} MiB in memory, built in {time.perf_counter() - t0:.1f} s)")
    workdir = Path(tempfile.mkdtemp(prefix="refinery-bench-"))
    try:
        store = bench_append(table, workdir, a.repeats, figures)
        del table
        bench_groups(store, a.repeats, figures)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=1, sort_keys=True))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
