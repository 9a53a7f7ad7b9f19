"""Prompt utility: the Exploration Potential Score and buckets (arXiv 2609.15051 §2.2; docs/algorithms.md §1).

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
own samples it kept).
"""

from __future__ import annotations

import polars as pl

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
