"""Store bookkeeping that every stage reads the same way: a round's rows, the prompts table, a run's strata.

Choices, and why:
- The prompts table is content-addressed and append-only, so one prompt may land more than once (the same
  child proposed in two rounds, an ingest repeated): `prompts` always reads it unique by `prompt_id`.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def in_strata(store: Store, run_id: str, strata: Sequence[str]) -> pl.LazyFrame:
    """The prompt ids of `run_id`'s pool in these strata: the originals its round-0 pool rows record there (the
    held-out split's strata) and every prompt refined from them (a child's `root_id` names its original, so a
    ladder rung or a softer sibling stays in its root's stratum). A stratum no row records is refused by name."""
    rows = this_round(store, "pool", run_id, 0).select("prompt_id", "stratum")
    known = set(rows.select("stratum").unique().collect()["stratum"].drop_nulls().to_list())
    if missing := [s for s in strata if s not in known]:
        raise ValueError(f"select.strata: run {run_id}'s pool records no stratum {missing[0]!r} (its strata: "
                         f"{', '.join(sorted(known)) or 'none; eval.heldout_split = stratified records them'})")
    roots = rows.filter(pl.col("stratum").is_in(strata)).select(pl.col("prompt_id").alias("root_id"))
    return prompts(store, "root_id").join(roots, on="root_id", how="semi").select("prompt_id")


def pool_candidates(store: Store, run_id: str, round: int, include_reserve: bool,
                    strata: Sequence[str] = (), columns: Sequence[str] = ("prompt_id",)) -> pl.LazyFrame:
    """The prompt ids (and other pool `columns`) a round may draw from: its active pool members, reserve ones if
    asked, and of `strata` only when it names any (select.strata). Selection, screening's refills, DAPO's
    batches, the `all` selector, the Sampler and the curriculum export read the pool through this one filter."""
    statuses = ["active", "reserve"] if include_reserve else ["active"]
    ids = this_round(store, "pool", run_id, round).filter(pl.col("status").is_in(statuses)).select(*columns)
    return ids.join(in_strata(store, run_id, strata), on="prompt_id", how="semi") if strata else ids
