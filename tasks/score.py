"""Score stage: EPS and bucket for every group of the round's rollouts, on the policy's own samples ->
`prompt_scores` (the method: tasks/core/eps.py, docs/algorithms.md §1). The summary counts LoPE-rescued groups
apart, with their own-sample buckets.

A screened-out prompt (collect's screening: tasks/sampling/screening.py) is scored too, on its k screening
samples (`discarded_rollouts` rows with reason `screened_out`; `n` says how few): they are all the round learnt
about it, and unscored it would stay "never scored" for EPS-weighted selection, which would draw it again every
round with the exploration bonus, and it would never reach refinement or shaping, which exist for the prompts it
fails. Its group is unanimous, so it is scored too_hard or saturated, never informative. DAPO's discards
(`zero_variance`, `surplus`) stay unscored: the dapo_filter baseline scores what it keeps, as before.
"""

from __future__ import annotations

import polars as pl
from pydantic import Field

from models.config import Section
from storage.store import Store
from tasks.core.dapo import SCREENED_OUT
from tasks.core.eps import eps_scores, lope_replaced, own_samples
from tasks.stage import RoundContext, stage


class UtilityConfig(Section):
    """EPS, the prompt utility that buckets and weights prompts (docs/algorithms.md §1)."""

    beta: float = Field(0.5, gt=0.0, le=100.0, description="EPS temperature: small favours hard-but-solvable")
    tau: float = Field(0.0, ge=0.0, le=1.0, description="EPS threshold for 'informative' and reactivation")
    eps: float = Field(1e-6, gt=0.0, le=0.1, description="tolerance for constant groups")


@stage("score")
def score_task(ctx: RoundContext, store: Store, cfg: UtilityConfig) -> dict:
    """EPS and bucket per group -> `prompt_scores`; `rescued` counts LoPE-rescued groups by own-sample bucket."""
    rollouts = ctx.rows(store, "rollouts").collect()
    screened = ctx.rows(store, "discarded_rollouts").filter(pl.col("reason") == SCREENED_OUT).collect()
    scored = pl.concat([rollouts, screened.select(rollouts.columns)], how="vertical_relaxed") if screened.height else rollouts
    scores = eps_scores(own_samples(scored).collect(), cfg.beta, cfg.tau, cfg.eps)
    store.commit("score", {"prompt_scores": scores.to_arrow()}, run_id=ctx.run_id, round=ctx.round)
    counts = dict(scores.group_by("bucket").len().iter_rows())
    # from the stored rows: own_samples drops the replaced slots of older stores, yet their groups were rescued
    rescued = scores.join(rollouts.filter(lope_replaced()).select("prompt_id").unique(), on="prompt_id", how="semi")
    return {"prompts": scores.height, "buckets": counts, "screened_out": screened["prompt_id"].n_unique(),
            "rescued": {"groups": rescued.height, **dict(rescued.group_by("bucket").len().sort("bucket").iter_rows())}}
