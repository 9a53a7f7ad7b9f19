"""Golden runs: small seeded curriculum runs (the scripted policy over every stage, the tiny random model over
the real sampler and refinement with the policy as teacher; `resume`, the scripted run without training so
that it needs no checkpoint files to go on) whose stores, written once by older code, are kept under
tests/data/golden/ (tests/data/golden/make_stores.py writes them; MANIFEST.json names the commit).

`table_rows` is a table in canonical form: rows sorted, columns that measure time or name where the store
lives dropped (created_at, seconds, host, pid, the stored config, a checkpoint's absolute path), so two runs of
the same seeded config compare equal however long they took and wherever they ran. Floats compare within a
tolerance (`frames_match`): a restructuring must not change them, but another CPU's kernels may move the last
bits."""

from __future__ import annotations

import hashlib
import json
import math

import polars as pl

from storage.query import scan, sql
from storage.schemas import TABLES

UNSOLVED = "tests/data/golden/unsolved.jsonl"  # relative: the stored config and rows must not name a checkout

RUNS = {
    "scripted": {"rounds": 2, "sets": [
        "model.policy=tiny-random", "model.backend=scripted", "model.dtype=fp32",
        "rollout.group_size=4", "rollout.max_new_tokens=40", "rollout.include_reserve=true",
        "rollout.fewshot_p0=1.0", "rollout.lope_prefixes=6", "rollout.lope_max_groups=1",
        "select.embedder=hashing", "select.batch_size=12",
        'refine.strategies=["ladder", "hint_prefix", "harden"]', "refine.teacher_distractors=false",
        "shape.enabled=true",  # as the stores were written (the default then)
        "shape.teacher_traces=false", "shape.steps=6", "shape.max_traces=4", "shape.max_new_tokens=32",
        "train.lr=1e-3", "eval.n_samples=4", "eval.k=2", "governor.enabled=false",
        "eval.decoding=sampled", "eval.milestone_tokens=0", "eval.heldout_split=flat",  # as the stores were written
        "pool.rg_solutions=false",  # as the stores were written
        "rollout.screen_samples=0",  # as the stores were written (G samples at once)
        'pool.sources=[{"source": "rg:products", "size": 6, "params": {"max_digits": 1}}, '
        '{"source": "rg:chain_sum", "size": 6, "params": {"min_terms": 2, "max_terms": 2, "max_digits": 1}}, '
        f'{{"source": "{UNSOLVED}"}}]']},
    # the tiny run samples at T = 0.1: at 0.7 the random model's next-token distribution is nearly flat (top
    # token ~3%), so float rounding that moves with the CPU's kernels, the thread count or the decode batch's
    # rows flipped 1-2% of 16-token answers (docs/architecture.md, "Stores outlive code"); at 0.1, 0 of 960.
    # The golden rows must come out the same on every machine CI runs on, with 1 thread or 2.
    "tiny": {"rounds": 2, "sets": [
        "model.policy=tiny-random", "model.dtype=fp32", "rollout.max_new_tokens=4", "rollout.group_size=4",
        "rollout.temperature=0.1", "eval.temperature=0.1", "refine.teacher_temperature=0.1",
        "rollout.include_reserve=true", "select.embedder=hashing", "select.batch_size=6",
        "refine.teacher_max_new_tokens=16", "rollout.lope_prefixes=6", "rollout.lope_max_groups=2",
        "refine.scaffolds_from_policy=true", "governor.enabled=false",
        "shape.enabled=true",  # as the stores were written (the default then)
        'refine.strategies=["ladder", "teacher_scaffold", "hint_prefix", "harden"]',  # as the stores were written
        "eval.decoding=sampled", "eval.milestone_tokens=0", "eval.heldout_split=flat",  # as the stores were written
        "pool.rg_solutions=false",  # as the stores were written
        "rollout.screen_samples=0",  # as the stores were written (G samples at once)
        'pool.sources=[{"source": "rg:products", "size": 5, "params": {"max_digits": 1}}, '
        '{"source": "rg:chain_sum", "size": 3, "params": {"max_terms": 2, "max_digits": 1}}]']},
}

RUNS["resume"] = {"rounds": 2, "sets": [s for s in RUNS["scripted"]["sets"] if not s.startswith("train.")]
                 + ["train.enabled=false"]}

# columns that measure time or name the store's location, per table (every table also drops created_at)
VOLATILE = {"runs": {"config", "host", "pid", "commit", "dirty"}, "train_steps": {"seconds"}, "checkpoints": {"path"}}

# questions a user asks of a store; an old store must answer them as it did when it was written
SQL = {
    "buckets": "SELECT round, bucket, count(*) AS n FROM prompt_scores WHERE run_id = '{run}' "
               "GROUP BY ALL ORDER BY ALL",
    "pass_rate": "SELECT round, count(*) AS n, round(avg(reward), 6) AS mean_reward FROM rollouts "
                 "WHERE run_id = '{run}' GROUP BY round ORDER BY round",
    "lineage": "SELECT p.transform, count(*) AS n FROM prompts p JOIN pool USING (prompt_id) "
               "WHERE pool.run_id = '{run}' GROUP BY ALL ORDER BY ALL",
    "refinements": "SELECT round, strategy, accepted, count(*) AS n FROM refinements WHERE run_id = '{run}' "
                   "GROUP BY ALL ORDER BY ALL",
    "evals": "SELECT policy_version, split, pass_at_1 FROM evals WHERE run_id = '{run}' ORDER BY ALL",
}


def answers(store, run: str) -> dict:
    return {name: sql(store, text.format(run=run)).to_pylist() for name, text in SQL.items()}


def tables(store) -> list[str]:
    return sorted(t for t in TABLES if store.files(t))


def table_rows(store, table: str) -> pl.DataFrame:
    df = scan(store, table).collect()
    df = df.drop([c for c in df.columns if c == "created_at" or c in VOLATILE.get(table, set())])
    if table == "runs":  # its rows are status changes of one run: their order is the data
        return df.select("run_id", "status", "reason").sort("status")
    return df.sort(df.columns, nulls_last=True)


def _floats(df: pl.DataFrame) -> list[str]:
    return [c for c, t in df.schema.items() if t.is_float()]


def frames_match(a: pl.DataFrame, b: pl.DataFrame, rel: float = 1e-4, abs_: float = 1e-6) -> str | None:
    """None when `a` and `b` hold the same rows (floats within tolerance), else what differs first. A column
    only one side has and that holds nothing but nulls there is a column added since the other was written
    (storage/schemas.py: columns are added, never renamed; an old file reads it as null): it is left out."""
    added = [c for c in a.columns if c not in b.columns and a[c].null_count() == a.height]
    gone = [c for c in b.columns if c not in a.columns and b[c].null_count() == b.height]
    a, b = a.drop(added), b.drop(gone)
    if a.columns != b.columns:
        return f"columns {a.columns} != {b.columns}"
    if a.height != b.height:
        return f"{a.height} rows != {b.height} rows"
    exact = [c for c in a.columns if c not in _floats(a)]
    for c in exact:
        if not a[c].equals(b[c]):  # a list of floats (rollouts.token_logprobs) compares within tolerance too
            for i, (x, y) in enumerate(zip(a[c].to_list(), b[c].to_list())):
                if x != y and not _same_json(x, y, rel, abs_) and not (isinstance(x, list) and _close(x, y, rel, abs_)):
                    return f"column {c} row {i}: {x!r} != {y!r}"
    for c in _floats(a):
        for i, (x, y) in enumerate(zip(a[c], b[c])):
            if (x is None) != (y is None) or (x is not None and not (
                    math.isclose(x, y, rel_tol=rel, abs_tol=abs_) or (math.isnan(x) and math.isnan(y)))):
                return f"column {c} row {i}: {x!r} != {y!r}"
    return None


def _same_json(x, y, rel: float, abs_: float) -> bool:
    """Two JSON texts (a string column such as `augmentation`) holding the same values, their floats within
    tolerance like a float column's: a float written into a JSON text moves with training's float rounding."""
    if not (isinstance(x, str) and isinstance(y, str)):
        return False
    try:
        return _close(json.loads(x), json.loads(y), rel, abs_)
    except ValueError:
        return False


def _close(x, y, rel: float, abs_: float) -> bool:
    if isinstance(x, float) or isinstance(y, float):
        return (all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (x, y))
                and math.isclose(x, y, rel_tol=rel, abs_tol=abs_))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_close(x[k], y[k], rel, abs_) for k in x)
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_close(u, v, rel, abs_) for u, v in zip(x, y))
    return x == y


def row_digest(store) -> dict:
    """{table: {"rows": n, "sha256": digest of the exact (non-float) columns}}: what MANIFEST.json records."""
    out = {}
    for t in tables(store):
        df = table_rows(store, t)
        exact = df.drop(_floats(df)).to_dicts()
        h = hashlib.sha256(json.dumps(exact, sort_keys=True, default=str).encode()).hexdigest()
        out[t] = {"rows": df.height, "sha256": h}
    return out
