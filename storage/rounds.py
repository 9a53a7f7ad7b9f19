"""Store bookkeeping that every stage reads the same way: a round's rows, the prompts table.

Choices, and why:
- The prompts table is content-addressed and append-only, so one prompt may land more than once (the same
  child proposed in two rounds, an ingest repeated): `prompts` always reads it unique by `prompt_id`.
"""

from __future__ import annotations

import polars as pl

from storage.query import scan
from storage.store import Store


def this_round(store: Store, table: str, run_id: str, round: int) -> pl.LazyFrame:
    """Rows of `table` that belong to `run_id`'s round `round`."""
    return scan(store, table).filter((pl.col("run_id") == run_id) & (pl.col("round") == round))


def prompts(store: Store, *columns: str | pl.Expr) -> pl.LazyFrame:
    """The prompts table, one row per prompt_id, with `columns` (all of them when none is named)."""
    frame = scan(store, "prompts")
    if columns:
        frame = frame.select("prompt_id", *[c for c in columns if not (isinstance(c, str) and c == "prompt_id")])
    return frame.unique("prompt_id")
