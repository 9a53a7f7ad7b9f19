"""Few-shot demonstrations from the store: one correct rollout per solved prompt of the run's earlier rounds,
the pool fewshot_context (tasks/core/fewshot.py, docs/algorithms.md §3) draws from."""

from __future__ import annotations

import polars as pl

from storage.query import scan
from storage.rounds import prompts
from storage.store import Store


def demonstrations(store: Store, run_id: str, round: int) -> pl.DataFrame:
    """One correct rollout per solved prompt of this run's earlier rounds: prompt_id, source, root_id, question,
    completion."""
    solved = (scan(store, "rollouts")
              .filter((pl.col("run_id") == run_id) & (pl.col("round") < round) & pl.col("correct")
                      & pl.col("augmentation").is_null())
              .group_by("prompt_id").agg(pl.col("completion").sort_by(pl.col("n_tokens")).first()))
    return solved.join(prompts(store, "source", "root_id", pl.col("text").alias("question")), on="prompt_id").sort("prompt_id").collect()


