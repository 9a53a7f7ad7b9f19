"""A run's recorded checkpoints, read from the store's `checkpoints` table (one row per policy version).

The train stage records each version it makes, with the round that made it and its weights' folder
(models/checkpoints.py writes the folder); a commit in round 0 also records version 0, the run's starting
model, pointing at the resolved base. Version 0 is never recorded alone, so a run with any rows has a trained
version, and the newest trained version is the newest version there is.
"""

from __future__ import annotations

import polars as pl

from storage.query import scan
from storage.store import Store


def checkpoint_versions(store: Store, run_id: str) -> pl.DataFrame:
    """The run's recorded checkpoints, oldest first: one row per policy_version (round, path, parent_version,
    created_at)."""
    return (scan(store, "checkpoints").filter(pl.col("run_id") == run_id)
            .unique(["run_id", "policy_version"]).sort("policy_version").collect())


def newest_checkpoint(store: Store, run_id: str, base: str, before_round: int | None = None) -> tuple[int, str]:
    """(policy_version, path) of the run's newest trained checkpoint, made before round `before_round` when it
    is given; (0, `base`) when there is none (the configured base model is version 0)."""
    known = checkpoint_versions(store, run_id).filter(pl.col("policy_version") > 0)
    if before_round is not None:
        known = known.filter(pl.col("round") < before_round)
    if known.height == 0:
        return 0, base
    last = known.row(-1, named=True)
    return int(last["policy_version"]), last["path"]
