"""The run's token budget spent: one sum, read by the flow (before each round, against `max_generated_tokens`,
and for evaluation milestones: flows/curriculum.py) and by the end-of-run summary (tasks/reporting/summary.py).

The sum is of `generated_tokens` rows (models/meter.py: every stage's generation, teacher answers and MCMC
proposals included) with purpose other than `eval`: evaluation samples are a measurement of the method, not
part of what it costs, so they never count towards the budget or the figure printed beside it.
"""

from __future__ import annotations

import polars as pl

from storage.query import scan
from storage.store import Store


def spent_tokens(store: Store, run_id: str, before_round: int | None = None) -> int:
    """Run `run_id`'s generated tokens, evaluation excluded: of its rounds before `before_round`, or of all of
    them (None)."""
    rows = scan(store, "generated_tokens").filter((pl.col("run_id") == run_id) & (pl.col("purpose") != "eval"))
    if before_round is not None:
        rows = rows.filter(pl.col("round") < before_round)
    return int(rows.select(pl.col("tokens").sum()).collect().item() or 0)
