"""A run's recorded checkpoints, read from the store's `checkpoints` table (one row per policy version).

The train stage records each version it makes, with the round that made it and its weights' folder
(models/checkpoints.py writes the folder); a commit in round 0 also records version 0, the run's starting
model, naming the base (models/registry.py `recorded_spec`). Version 0 is never recorded alone, so a run with
any rows has a trained version, and the newest trained version is the newest version there is.

Paths: a local store records its own checkpoint folders relative to its root (`_checkpoints/run_id=<run>/v<N>`:
`recorded_path`), so a store that is moved, copied or committed (the golden fixtures, the evidence store) still
finds them; reading resolves them against the store's root (`checkpoint_versions`), so every caller sees a folder it
can load. Rows written before hold absolute paths and are read as they are; a remote store records URIs.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from storage.query import scan
from storage.store import Store

OWN = "_checkpoints/"  # a local store's own checkpoint folders, recorded relative to its root


def recorded_path(store: Store, path: str) -> str:
    """How a checkpoint folder is recorded: relative to the root when it is this local store's own folder."""
    if store.local:
        own = Path(store.root, OWN).resolve()
        folder = Path(path).resolve()
        if folder.is_relative_to(own):
            return str(folder.relative_to(own.parent).as_posix())
    return path


def checkpoint_versions(store: Store, run_id: str) -> pl.DataFrame:
    """The run's recorded checkpoints, oldest first: one row per policy_version (round, path resolved against
    the store, parent_version, created_at)."""
    rows = (scan(store, "checkpoints").filter(pl.col("run_id") == run_id)
            .unique(["run_id", "policy_version"]).sort("policy_version").collect())
    if not store.local:
        return rows
    own = pl.col("path").str.starts_with(OWN)
    return rows.with_columns(pl.when(own).then(pl.lit(str(Path(store.root)) + "/") + pl.col("path"))
                             .otherwise(pl.col("path")).alias("path"))


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
