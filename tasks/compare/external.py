"""The external sets on the comparison page: each arm's pass@1 on a prompt file, per kind, at the matched budget
(issue 49, item 6).

flows/compare.py scores each external set on every run's checkpoint at its largest generated-token milestone
within the token budget (the checkpoint the held-out curve is read at when every run reached that milestone)
and on its last checkpoint, and on the base model once. Here the page takes, for every run alike, the checkpoint
evaluated at the matched token budget when every run's has an external score (`matched`), and otherwise each
run's last checkpoint (`last`: a store whose runs were evaluated every round, like the v1 store, has no
checkpoint at an interpolated budget); the page says which it used. Differences to the base arm are paired by
seed, over prompts and seeds, as on the held-out set. A file whose rows carry `meta.kind` (`near`, `far`) is
also reported per kind.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from storage.query import sql
from storage.store import Store, check_name
from tasks.core.stats import Interval, bootstrap_mean, paired_difference


def kinds(store: Store, name: str) -> dict[str, str]:
    """prompt_id -> meta.kind of a dataset's prompts ('all' where the file has no kinds)."""
    check_name("dataset name", name)  # so the name needs no quoting below
    t = pl.from_arrow(sql(store, f"SELECT prompt_id, json_extract_string(meta, '$.kind') AS kind FROM prompts "
                                 f"WHERE source = '{name}'"))
    return {p: k or "all" for p, k in zip(t["prompt_id"], t["kind"])}


def kind_groups(kinds: dict[str, str]) -> dict[str, list[str]]:
    """'all' and, when the file has more than one kind, each kind: its prompt ids."""
    labels = sorted(set(kinds.values()))
    return {"all": list(kinds)} | ({k: [p for p, v in kinds.items() if v == k] for k in labels} if len(labels) > 1 else {})


def matched_versions(curves: dict, budget: float) -> dict[str, int | None]:
    """run_id -> the newest checkpoint whose held-out cost on the token axis is exactly `budget` (a milestone it
    was evaluated at), None where the budget falls between checkpoints."""
    out = {}
    for run_id, c in curves.items():
        hits = [v for v, t in zip(c.versions, c.costs["tokens"]) if t == budget]
        out[run_id] = hits[-1] if hits else None
    return out


def choose(rows: pl.DataFrame, run_ids: list[str], matched: dict[str, int | None]) -> tuple[dict[str, int], str]:
    """(run_id -> the version to read, 'matched' or 'last'): the matched checkpoints when every run has an
    external score there, else every run's last scored checkpoint."""
    scored = {r: set(rows.filter(pl.col("run_id") == r)["policy_version"].to_list()) for r in run_ids}
    if all(matched.get(r) is not None and matched[r] in scored[r] for r in run_ids):
        return {r: matched[r] for r in run_ids}, "matched"
    return {r: max(v) for r, v in scored.items() if v}, "last"


def _matrix(rows: pl.DataFrame, run_ids: list[str], keep, versions: dict[str, int]) -> np.ndarray | None:
    mats = []
    for r in run_ids:
        if r not in versions:
            return None
        mine = rows.filter((pl.col("run_id") == r) & (pl.col("policy_version") == versions[r])).sort("prompt_id")
        mats.append(mine.filter(pl.col("prompt_id").is_in(keep))["pass1"].to_numpy())
    return np.vstack(mats) if mats and len({m.size for m in mats}) == 1 and mats[0].size else None


def external(rows, kinds_of, ids, seeds, base_runs, is_base, versions) -> dict[str, tuple[Interval, Interval | None]]:
    """kind -> (the arm's pass@1, its paired difference to the base arm) at `versions` (run_id -> version)."""
    out = {}
    for label, keep in kind_groups(kinds_of).items():
        x = _matrix(rows, ids, keep, versions)
        if x is None:
            continue
        common = [s for s in seeds if s in [b.seed for b in base_runs]]
        d = None
        if not is_base and common:
            a = _matrix(rows, [ids[seeds.index(s)] for s in common], keep, versions)
            b = _matrix(rows, [next(r.run_id for r in base_runs if r.seed == s) for s in common], keep, versions)
            d = paired_difference(a, b) if a is not None and b is not None else None
        out[label] = (bootstrap_mean(x), d)
    return out
