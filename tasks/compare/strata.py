"""Held-out pass@1 per stratum, and the strata no checkpoint ever solves (issue 49, item 3).

A stratum is one pool source entry (tasks/core/heldout.py `stratum_name`: source and difficulty params). Runs
split "stratified" record it in `pool.stratum`; older runs (the committed v1 store, "flat") leave it null, and
their stratum is read off the prompt's own row: its `source` and generator `params` less `seed` and `size`
(which name the draw, not the difficulty), the same name the stratified split would give (`STRATA` returns
both; the first source entry that lists a prompt owns it, as in the split).

A stratum whose every held-out prompt scores 0 at every evaluated checkpoint of every run of the comparison
(the base model included) is "never solved": it adds nothing but dilution to every difference (in the v1
store 19 of 106 held-out prompts, every 2-digit product and 3-4-term 2-digit sum, dilute each difference by
about 18%). The page flags it and gives each arm's total with and without it; it is never silently dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import polars as pl

from storage.query import sql
from storage.store import Store, check_name
from tasks.core.heldout import stratum_name
from tasks.core.stats import Interval, bootstrap_mean, paired_difference

STRATA = """
SELECT l.prompt_id, l.stratum, p.source, p.params
FROM pool l JOIN prompts p USING (prompt_id)
WHERE l.run_id = '{run_id}' AND l.round = 0 AND l.status = 'heldout'
QUALIFY row_number() OVER (PARTITION BY l.prompt_id ORDER BY p.created_at, p.source, p.params) = 1
ORDER BY l.prompt_id
""".strip()

DRAW_PARAMS = ("seed", "size")  # generator params that name the draw, not the difficulty


def query(run_id: str) -> str:
    check_name("run id", run_id)
    return STRATA.format(run_id=run_id)


def strata_of(store: Store, run_id: str) -> dict[str, str]:
    """prompt_id -> stratum of the held-out prompts of `run_id` (every run of a comparison holds out the same)."""
    t = pl.from_arrow(sql(store, query(run_id)))
    out = {}
    for pid, stratum, source, params in t.iter_rows():
        if stratum is None:
            given = json.loads(params) if params else {}
            stratum = stratum_name(source, {k: v for k, v in given.items() if k not in DRAW_PARAMS})
        out[pid] = stratum
    return out


@dataclass
class StratumFigures:
    name: str
    prompts: int
    never_solved: bool
    pass1: dict[str, float]  # arm -> mean pass@1 over its runs and the stratum's prompts, at the matched budget


def by_stratum(strata: dict[str, str], prompt_ids: list[str], at_budget: dict[str, np.ndarray],
               every_checkpoint: np.ndarray) -> list[StratumFigures]:
    """Per stratum (in order of first prompt id): prompts, whether `every_checkpoint` ([checkpoints of all runs,
    prompts]) never solves any of its prompts, and each arm's mean pass@1 at the budget (`at_budget`: arm ->
    [seeds, prompts], columns in `prompt_ids` order)."""
    names = list(dict.fromkeys(strata[p] for p in prompt_ids))
    out = []
    for name in names:
        cols = np.array([strata[p] == name for p in prompt_ids])
        out.append(StratumFigures(name, int(cols.sum()), bool(every_checkpoint[:, cols].max() == 0),
                                  {a: float(x[:, cols].mean()) for a, x in at_budget.items() if x is not None}))
    return out


def solved_columns(strata: dict[str, str], prompt_ids: list[str], figures: list[StratumFigures]) -> np.ndarray:
    """A mask of the prompts outside never-solved strata."""
    never = {f.name for f in figures if f.never_solved}
    return np.array([strata[p] not in never for p in prompt_ids])


def totals_without(at_budget: dict[str, np.ndarray], seeds: dict[str, list[int]], base_arm: str, keep: np.ndarray
                   ) -> dict[str, tuple[Interval, Interval | None]]:
    """arm -> (pass@1 over the prompts in `keep`, its paired difference to `base_arm` over their common seeds)."""
    out = {}
    base = at_budget.get(base_arm)
    for arm, x in at_budget.items():
        if x is None or not keep.any():
            continue
        common = [s for s in seeds[arm] if s in seeds[base_arm]] if arm != base_arm and base is not None else []
        d = None
        if common:
            a = x[[seeds[arm].index(s) for s in common]][:, keep]
            b = base[[seeds[base_arm].index(s) for s in common]][:, keep]
            d = paired_difference(a, b)
        out[arm] = (bootstrap_mean(x[:, keep]), d)
    return out
