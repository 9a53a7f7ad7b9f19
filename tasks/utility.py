"""Prompt utility: the Exploration Potential Score and buckets (arXiv 2609.15051 §2.2; ALGORITHMS.md §1),
and the pool's per-round status (ALGORITHMS.md §2).

EPS(x) = sum_i softmax(r/beta)_i * r_i - mean(r): the gain of the KL-regularised improved policy over the
current one, estimated on the group GRPO already sampled. It is 0 for constant groups. Computed in one
polars pass over all groups (stable softmax: the group max is subtracted before exp), no per-prompt loop.

Buckets (tolerance eps): informative (std > eps and EPS > tau), saturated (all r >= 1 - eps), too_hard
(all r <= eps), flat (everything else: constant partial credit, or a varied group with EPS <= tau).
"""

from __future__ import annotations

import polars as pl
from prefect import task

from storage.query import scan
from storage.store import Store
from tasks.reporting import timed

GROUP_KEYS = ["run_id", "round", "policy_version", "prompt_id"]

# Readers of one round's score distribution keep to the round's own scores with this SQL clause: a rescore
# (tasks/rescore.py) adds rows of a newer policy_version to the round it rescored, which the next round's pool
# and selection are meant to read.
ROUND_OWN_SCORES = "QUALIFY policy_version = min(policy_version) OVER (PARTITION BY run_id, round)"


def eps_scores(rollouts: pl.LazyFrame | pl.DataFrame, beta: float = 0.5, tau: float = 0.0,
               eps: float = 1e-6) -> pl.DataFrame:
    """One prompt_scores row per (run_id, round, policy_version, prompt_id) group of `rollouts`."""
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    r = pl.col("reward")
    w = ((r - r.max()) / beta).exp()
    scored = rollouts.lazy().group_by(GROUP_KEYS).agg(
        n=pl.len().cast(pl.Int32),
        mean_reward=r.mean(),
        std_reward=r.std(ddof=0),
        eps=(w * r).sum() / w.sum() - r.mean(),
        r_min=r.min(),
        r_max=r.max(),
    )
    bucket = (
        pl.when((pl.col("std_reward") > eps) & (pl.col("eps") > tau)).then(pl.lit("informative"))
        .when(pl.col("r_min") >= 1 - eps).then(pl.lit("saturated"))
        .when(pl.col("r_max") <= eps).then(pl.lit("too_hard"))
        .otherwise(pl.lit("flat"))
    )
    return (
        # a constant group has EPS exactly 0; without this, rounding leaves values of order 1e-17
        scored.with_columns(eps=pl.when(pl.col("std_reward") > eps).then(pl.col("eps")).otherwise(0.0),
                            bucket=bucket)
        .drop("r_min", "r_max")
        .sort(GROUP_KEYS)
        .collect()
    )


def next_pool(pool: pl.DataFrame, scores: pl.DataFrame, prompts: pl.DataFrame, round: int,
              refinements: pl.DataFrame | None = None) -> pl.DataFrame:
    """Pool membership for `round` from the previous round's pool, scores and refinements.

    - an active original whose bucket is not informative moves to reserve (it is not discarded);
    - a reserve prompt that scored informative (EPS > tau) again is reactivated;
    - accepted refinement children join as active; a promotion retires the easier variant and activates
      the harder one (for the last rung, the original question itself);
    - everything else keeps its status. Prompts without a score keep theirs.
    `prompts` supplies each prompt's transform (only originals go to reserve; rewrites stay active).
    """
    joined = (
        pool.select("prompt_id", "status", "level")
        .join(scores.select("prompt_id", "bucket"), on="prompt_id", how="left")
        .join(prompts.select("prompt_id", "transform"), on="prompt_id", how="left")
    )
    informative = pl.col("bucket") == "informative"
    status = (
        pl.when((pl.col("status") == "active") & pl.col("bucket").is_not_null() & ~informative
                & (pl.col("transform") == "original")).then(pl.lit("reserve"))
        .when((pl.col("status") == "reserve") & informative).then(pl.lit("active"))
        .otherwise(pl.col("status"))
    )
    run_id = pool["run_id"][0] if "run_id" in pool.columns and pool.height else None
    out = joined.select("prompt_id", status.alias("status"), "level")
    if refinements is not None and refinements.height:
        acc = refinements.filter(pl.col("accepted"))
        retired = acc.filter(pl.col("strategy") == "promote")["parent_id"]
        born = acc.select("child_id").unique()
        out = out.with_columns(status=pl.when(pl.col("prompt_id").is_in(retired.implode())).then(pl.lit("retired"))
                               .when(pl.col("prompt_id").is_in(born["child_id"].implode())).then(pl.lit("active"))
                               .otherwise(pl.col("status")))
        new = born.join(out, left_on="child_id", right_on="prompt_id", how="anti").select(
            pl.col("child_id").alias("prompt_id"), pl.lit("active").alias("status"),
            pl.lit(None, pl.String).alias("level"))
        out = pl.concat([out, new], how="vertical_relaxed")
    levels = prompts.select("prompt_id", pl.col("transform").alias("_t"))
    out = out.join(levels, on="prompt_id", how="left").with_columns(
        level=pl.when(pl.col("_t").is_in(["mcq4", "mcq10", "cloze"])).then(pl.col("_t")).otherwise(pl.col("level")))
    return out.select(
        pl.lit(run_id, pl.String).alias("run_id"), pl.lit(round, pl.Int32).alias("round"), "prompt_id",
        "status", "level",
    ).sort("prompt_id")


def score(store: Store, run_id: str, round: int, beta: float, tau: float, eps: float) -> dict:
    """Score stage: EPS and bucket for every group of the round's rollouts -> `prompt_scores`."""
    if store.landed(run_id, round, "score"):
        return {"stage": "score", "round": round, "skipped": "already landed"}
    rollouts = scan(store, "rollouts").filter((pl.col("run_id") == run_id) & (pl.col("round") == round))
    scores = eps_scores(rollouts, beta, tau, eps)
    store.commit("score", {"prompt_scores": scores.to_arrow()}, run_id=run_id, round=round)
    counts = dict(scores.group_by("bucket").len().iter_rows())
    return {"stage": "score", "round": round, "prompts": scores.height, "buckets": counts}


@task(name="score")
@timed
def score_task(store_uri: str, run_id: str, round: int, beta: float, tau: float, eps: float) -> dict:
    return score(Store(store_uri), run_id, round, beta, tau, eps)
