"""Prompt utility: the Exploration Potential Score and buckets (arXiv 2609.15051 §2.2; docs/algorithms.md §1),
and the pool's per-round status (docs/algorithms.md §2).

EPS(x) = sum_i softmax(r/beta)_i * r_i - mean(r): the gain of the KL-regularised improved policy over the
current one, estimated on the group GRPO already sampled. It is 0 for constant groups. Computed in one
polars pass over all groups (stable softmax: the group max is subtracted before exp), no per-prompt loop.

Buckets (tolerance eps): informative (std > eps and EPS > tau), saturated (all r >= 1 - eps), too_hard
(all r <= eps), flat (everything else: constant partial credit, or a varied group with EPS <= tau).

Only the policy's own G samples are scored (`own_samples`). LoPE (tasks/core/lope.py) replaces failures of an
all-fail group with correct resamples drawn under Lorem-Ipsum prefixes; those feed training only. Scored as
they are, a group the policy got 0/8 with 6 replacements would read mean 0.75, EPS 0.207, informative, and so
never count as too hard (no ladder, hint or scaffold, no move to reserve), be promoted, and skip shaping. A
replacement row records the reward of the own sample it displaced (`own_reward`), and scoring puts that
sample back; a store written before that was recorded leaves replaced slots out (the group is scored on the
own samples it kept). The score summary counts rescued groups apart, with their own-sample buckets.
"""

from __future__ import annotations

import polars as pl
from prefect import task
from pydantic import Field

from models.config import Section
from storage.query import scan
from storage.store import Store
from tasks.reporting import timed


class UtilityConfig(Section):
    beta: float = Field(0.5, gt=0.0, le=100.0, description="EPS temperature: small favours hard-but-solvable")
    tau: float = Field(0.0, ge=0.0, le=1.0, description="EPS threshold for 'informative' and reactivation")
    eps: float = Field(1e-6, gt=0.0, le=0.1, description="tolerance for constant groups")

GROUP_KEYS = ["run_id", "round", "policy_version", "prompt_id"]

# Readers of one round's score distribution keep to the round's own scores with this SQL clause: a rescore
# (tasks/rescore.py) adds rows of a newer policy_version to the round it rescored, which the next round's pool
# and selection are meant to read.
ROUND_OWN_SCORES = "QUALIFY policy_version = min(policy_version) OVER (PARTITION BY run_id, round)"


def lope_replaced() -> pl.Expr:
    """Whether a rollout row is a LoPE replacement (the polars twin of tasks.core.lope.is_lope_replaced)."""
    return pl.col("augmentation").str.json_path_match("$.lorem_perturb.replaced").fill_null("false") == "true"


def own_samples(rollouts: pl.LazyFrame | pl.DataFrame) -> pl.LazyFrame:
    """The policy's own samples of each group: a LoPE replacement row stands for the sample it replaced, with
    that sample's `own_reward` and `correct` false (LoPE only replaces failures); a replacement without a
    recorded own reward (older stores) is left out. Adds `lope_replaced` (the row was replaced), so callers
    can count rescued groups."""
    lf = rollouts.lazy()
    names = lf.collect_schema().names()
    if "augmentation" not in names:
        return lf.with_columns(lope_replaced=pl.lit(False))
    replaced = pl.col("lope_replaced")
    own_reward = pl.col("augmentation").str.json_path_match("$.lorem_perturb.own_reward").cast(pl.Float64)
    own = {"reward": pl.when(replaced).then(own_reward).otherwise(pl.col("reward"))}
    if "correct" in names:
        own["correct"] = pl.when(replaced).then(False).otherwise(pl.col("correct"))
    return lf.with_columns(lope_replaced=lope_replaced()).with_columns(**own).filter(pl.col("reward").is_not_null())


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
    """Score stage: EPS and bucket for every group of the round's rollouts, on the policy's own samples ->
    `prompt_scores`. The summary's `rescued` counts the LoPE-rescued groups and their (own-sample) buckets."""
    if store.landed(run_id, round, "score"):
        return {"stage": "score", "round": round, "skipped": "already landed"}
    rollouts = scan(store, "rollouts").filter((pl.col("run_id") == run_id) & (pl.col("round") == round)).collect()
    scores = eps_scores(own_samples(rollouts).collect(), beta, tau, eps)
    store.commit("score", {"prompt_scores": scores.to_arrow()}, run_id=run_id, round=round)
    counts = dict(scores.group_by("bucket").len().iter_rows())
    # from the stored rows: own_samples drops the replaced slots of older stores, yet their groups were rescued
    rescued = scores.join(rollouts.filter(lope_replaced()).select("prompt_id").unique(), on="prompt_id", how="semi")
    return {"stage": "score", "round": round, "prompts": scores.height, "buckets": counts,
            "rescued": {"groups": rescued.height, **dict(rescued.group_by("bucket").len().sort("bucket").iter_rows())}}


@task(name="score")
@timed
def score_task(store_uri: str, run_id: str, round: int, beta: float, tau: float, eps: float) -> dict:
    return score(Store(store_uri), run_id, round, beta, tau, eps)
