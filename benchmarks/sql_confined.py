"""What confining user SQL costs: `storage.query.sql` against direct `read_parquet` views.

`sql` (behind `refinery sql`) reads through registered pyarrow datasets on a DuckDB connection that has no
file access; the baseline is `query.connect`, the views over `read_parquet` that user SQL ran on before (and
that the project's own code still uses). Both are timed per query including connection set-up (listing the
commit records, creating the views), medians over --repeats run in turn, on N synthetic rollouts (default 1,000,000,
as in benchmarks/store.py) committed as 10 stages. Ratio = sql / direct.

--json PATH writes the figures as flat keys: per query q (its name in snake case) <q>_direct_s, <q>_sql_s
and <q>_ratio.

    python benchmarks/sql_confined.py                # full size
    python benchmarks/sql_confined.py --rows 100000  # quick
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run as a script, this folder's select.py would shadow the standard library's `select`
import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pyarrow.compute as pc  # noqa: E402

from storage import query  # noqa: E402
from storage.store import Store  # noqa: E402

QUERIES = {
    "group stats": "SELECT round, prompt_id, count(*) AS n, avg(reward) AS mean, stddev_pop(reward) AS std "
                   "FROM rollouts GROUP BY round, prompt_id",
    "sum of completion lengths": "SELECT sum(length(completion)) AS chars FROM rollouts",
    "point filter": "SELECT count(*) AS n FROM rollouts WHERE prompt_id = 'p00042'",
    "all columns of 1/80": "SELECT * FROM rollouts WHERE round = 3 AND sample_idx = 0",
}


def _synthetic_rollouts(n: int):
    spec = importlib.util.spec_from_file_location("bench_store", Path(__file__).with_name("store.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.synthetic_rollouts(n)


def interleaved(fns, repeats: int) -> list[tuple[float, object]]:
    """Median time and last result of each function, run in turn (A, B, A, B, ...) so that a machine's
    changing load falls on both alike."""
    times: list[list[float]] = [[] for _ in fns]
    outs: list[object] = [None] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            outs[i] = fn()
            times[i].append(time.perf_counter() - t0)
    return [(statistics.median(t), out) for t, out in zip(times, outs)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None, metavar="PATH", help="write the figures as flat keys")
    a = ap.parse_args()
    figures = {}
    workdir = Path(tempfile.mkdtemp(prefix="refinery-sql-bench-"))
    try:
        store = Store(workdir / "store")
        table = _synthetic_rollouts(a.rows)
        for r in range(10):
            store.commit("collect", {"rollouts": table.filter(pc.equal(table["round"], r))}, run_id="bench", round=r)
        del table
        size = sum(os.path.getsize(f) for f in store.files("rollouts")) / 2**20
        print(f"data: {a.rows:,} rollouts in {len(store.files('rollouts'))} Parquet files, {size:.0f} MiB")
        for name, q in QUERIES.items():
            (direct_t, direct), (sql_t, confined) = interleaved(
                [lambda q=q: query.connect(store).sql(q).to_arrow_table(), lambda q=q: query.sql(store, q)], a.repeats)
            assert confined.num_rows == direct.num_rows, (name, confined.num_rows, direct.num_rows)
            print(f"{name:26s} direct {direct_t:6.3f} s   sql (confined) {sql_t:6.3f} s   ratio {sql_t / direct_t:4.2f}")
            key = re.sub(r"\W+", "_", name).strip("_")
            figures |= {f"{key}_direct_s": direct_t, f"{key}_sql_s": sql_t, f"{key}_ratio": sql_t / direct_t}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=1, sort_keys=True))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
