"""The run's token budget spent: one sum, read by the flow (before each round, against `max_generated_tokens`,
and for evaluation milestones: flows/curriculum.py) and by the end-of-run summary (tasks/reporting/summary.py).

The sum is of `generated_tokens` rows (models/meter.py: every stage's generation, teacher answers and MCMC
proposals included) with purpose other than `eval`: evaluation samples are a measurement of the method, not
part of what it costs, so they never count towards the budget or the figure printed beside it. That rule is
written here once, in the forms its readers need: `counted` (a polars predicate), `COUNTED_SQL` (for the
comparison's SQL, tasks/compare/figures.py), `counts` (one purpose); `spent_by_run` sums many runs at once
(the comparison's matrices, flows/compare.py); `tokens_by_round` gives one run's per round (the flow fits the
budget's last round from them: tasks/core/budget.py).
"""

from __future__ import annotations

import polars as pl

from storage.query import scan
from storage.store import Store

EVAL = "eval"  # the purpose of evaluation's samples
COUNTED_SQL = f"purpose <> '{EVAL}'"


def counted() -> pl.Expr:
    """`generated_tokens` rows that count towards a token budget."""
    return pl.col("purpose") != EVAL


def counts(purpose: str) -> bool:
    return purpose != EVAL


def spent_by_run(store: Store, run_ids: list[str]) -> dict[str, int]:
    """{run: its generated tokens, evaluation excluded} for `run_ids` (0 for a run with none)."""
    rows = (scan(store, "generated_tokens").filter(pl.col("run_id").is_in(run_ids) & counted())
            .group_by("run_id").agg(pl.col("tokens").sum()).collect())
    got = dict(zip(rows["run_id"].to_list(), rows["tokens"].to_list()))
    return {r: int(got.get(r) or 0) for r in run_ids}


def spent_tokens(store: Store, run_id: str, before_round: int | None = None) -> int:
    """Run `run_id`'s generated tokens, evaluation excluded: of its rounds before `before_round`, or of all of
    them (None)."""
    rows = scan(store, "generated_tokens").filter((pl.col("run_id") == run_id) & counted())
    if before_round is not None:
        rows = rows.filter(pl.col("round") < before_round)
    return int(rows.select(pl.col("tokens").sum()).collect().item() or 0)


def tokens_by_round(store: Store, run_id: str, rounds: int) -> list[int]:
    """Run `run_id`'s generated tokens, evaluation excluded, of each of its rounds 0..rounds-1 (0 for a round
    with none): what tasks/core/budget.py fits the budget's last round from."""
    rows = (scan(store, "generated_tokens").filter((pl.col("run_id") == run_id) & counted()
                                                   & (pl.col("round") < rounds))
            .group_by("round").agg(pl.col("tokens").sum()).collect())
    got = dict(zip(rows["round"].to_list(), rows["tokens"].to_list()))
    return [int(got.get(r) or 0) for r in range(rounds)]
