"""Select stage: choose the round's batch from the pool and land `selections` (and, for kmeans, `centroids`).

The configured selector (tasks/selectors/: one file each behind the `Selector` protocol, found by name in the
registry; their algorithms are pure functions in tasks/core/, docs/algorithms.md §4) makes the picks; this
stage reads the candidates and their latest EPS, embeds them when the selector `needs_embeddings`
(tasks/selectors/embed.py: kept per embedding space, so a `policy` embedder's new checkpoint starts afresh)
with last round's centroids in the same space to warm-start from, and commits what the selector returns.
`SelectConfig.selector`'s choices are the registered selectors' names.

Choices: "never scored" means no earlier round of this run scored the prompt, and a scored prompt's EPS is its
latest score (a prompt not selected last round keeps the EPS it had, rather than passing for new and taking
the bonus again).
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar, Literal

import numpy as np
import polars as pl
from pydantic import Field

from models.config import Section
from models.registry import load_model
from storage.query import scan
from storage.rounds import pool_candidates, prompts, this_round
from storage.store import Store
from tasks.core.seeds import round_seed
from tasks.reporting.progress import sig4
from tasks.selectors import REGISTRY, Candidates, RoundView, selector
from tasks.selectors.embed import cached_embeddings, embedding_space, policy_namespace
from tasks.stage import RoundContext, stage

SELECTORS = tuple(sorted(REGISTRY))  # the config's choices: every registered selector (tasks/selectors/)


class SelectConfig(Section):
    """Which prompts a round collects for (docs/algorithms.md §4): the selector, one of tasks/selectors/."""

    selector: Literal[SELECTORS] = Field(  # type: ignore[valid-type]  # the registry's names, known at import
        "kmeans", description="; ".join(f"{n}: {REGISTRY[n].description}" for n in SELECTORS))
    batch_size: int = Field(16, ge=1, le=10_000_000, description="B: prompts selected per round (a screened round "
                            "keeps B informative groups); 16 since evidence v5's pilots: small rounds keep sampling "
                            "on the shrinking policy (docs/algorithms.md §4)")
    k_max: int = Field(64, ge=1, le=4096, description="K = min(k_max, ceil(candidates / 8))")
    temperature: float = Field(0.1, gt=0.0, le=100.0, description="T_sel of the cluster-weight softmax")
    bonus: float = Field(0.1, ge=0.0, le=10.0, description="exploration bonus for never-scored prompts")
    embedder: Literal["minilm", "policy", "hashing"] = Field(
        "minilm", description="kmeans embeddings: minilm (packaged all-MiniLM-L6-v2), policy (the policy's "
        "mean hidden state) or hashing (hashed word n-grams, no model)")
    seed: int = Field(0, ge=0, description="selection seed; round r uses seed * 1000 + r (tasks/core/seeds.py)")
    dapo_oversample: float = Field(3.0, ge=1.0, le=100.0, description="dapo_filter: round 0's over-sampling "
                                   "factor (a generation batch draws ceil(factor * the groups still missing) "
                                   "prompts, the first ceil(factor * B); later rounds use 1 / last round's "
                                   "informative ratio, capped at 3; DAPO's recipe: 3)")
    dapo_max_batches: int = Field(10, ge=1, le=1000, description="dapo_filter: generation batches per round at "
                                  "most, the first included; a batch still short then trains on fewer than B "
                                  "groups, and the round's summary says so")
    minibatch_above: int = Field(20_000, ge=1, le=1_000_000_000, description="kmeans: with more candidates than "
                                 "this, cluster with MiniBatchKMeans (batches of 4096), since full Lloyd "
                                 "iterations over 10^5+ points are too slow")
    strata: list[str] = Field([], description="draw only pool prompts of these strata, and their refined "
                              "children (a pool source entry, named as tasks/core/heldout.py stratum_name does: "
                              "'rg:products{max_digits=1}'; eval.heldout_split 'stratified' records them): the "
                              "selection, screening's refills and DAPO's batches; empty: every prompt. The "
                              "held-out set stays the whole pool's: an oracle arm trains on one stratum")
    pass_rate_prior: Literal["fitted", "pooled"] = Field(
        "fitted", description="the pass-rate model's bin prior (thompson, screening; tasks/core/passrate.py): "
        "fitted (empirical Bayes: each bin's mean and spread across its prompts) or pooled (4 pseudo-samples of "
        "the bin's mean on Beta(1, 1), which over-predicts a mixed group after a unanimous screen)")

    # a run stored before the fitted prior existed drew with the pooled one: it resumes so
    absent_means: ClassVar[dict] = {"pass_rate_prior": "pooled"}


@stage("select")
def select_task(ctx: RoundContext, store: Store, cfg: SelectConfig, include_reserve: bool) -> dict:
    """Choose the round's batch from the pool, land `selections` (and `centroids`)."""
    earlier = (pl.col("run_id") == ctx.run_id) & (pl.col("round") < ctx.round)
    pool = pool_candidates(store, ctx.run_id, ctx.round, include_reserve, cfg.strata)
    # each prompt's latest score in this run; a prompt no earlier round scored has none (it is never scored)
    scores = (scan(store, "prompt_scores").filter(earlier).sort("round", "policy_version")
              .group_by("prompt_id").last().select("prompt_id", "eps"))
    cand = (pool.join(prompts(store, "text"), on="prompt_id").join(scores, on="prompt_id", how="left")
            .sort("prompt_id").collect())
    if cand.height == 0:
        raise ValueError(f"run {ctx.run_id} round {ctx.round}: no candidate prompts to select from")
    ids = cand["prompt_id"].to_list()
    eps = cand["eps"].fill_null(np.nan).to_numpy().astype(float)
    chosen = selector(cfg.selector)
    candidates, extra = Candidates(cand, eps), {}
    if chosen.needs_embeddings:
        candidates, extra = embedded(ctx, store, cfg, candidates)
    picks = chosen.select(candidates, RoundView(ctx, store, round_seed(cfg.seed, ctx.round)), cfg)
    tables = {name: this_rows(frame, ctx, cfg.selector).to_arrow() for name, frame in picks.tables.items()}
    if picks.centroids is not None:
        tables["centroids"] = picks.centroids.with_columns(pl.lit(ctx.run_id).alias("run_id"),
                                                           pl.lit(ctx.round, pl.Int32).alias("round"),
                                                           pl.lit(candidates.space).alias("embedder")).to_arrow()
    sel = this_rows(picks.rows, ctx, cfg.selector)
    tables["selections"] = sel.to_arrow()
    store.commit("select", tables, run_id=ctx.run_id, round=ctx.round)
    picked = np.isin(np.asarray(ids), sel["prompt_id"].to_numpy())
    scored = ~np.isnan(eps)

    def mean_eps(mask: np.ndarray) -> float:  # over prompts scored in an earlier round; never-scored ones have none
        return sig4(float(eps[mask & scored].mean())) if (mask & scored).any() else 0.0

    return {"selector": cfg.selector, "candidates": len(ids),
            "selected": sel.height, "selected_unscored": int((picked & ~scored).sum()),
            "mean_eps_selected": mean_eps(picked), "mean_eps_pool": mean_eps(np.ones_like(picked)),
            **extra, **picks.summary}


def embedded(ctx: RoundContext, store: Store, cfg: SelectConfig, candidates: Candidates) -> tuple[Candidates, dict]:
    """The candidates with their vectors in `cfg.embedder`'s space (embedding only prompts that have none there
    yet) and last round's centroids in that space; and the summary's embedding figures."""
    backend = load_model(ctx.model) if cfg.embedder == "policy" else None
    namespace = policy_namespace(store, ctx.run_id, ctx.policy) if cfg.embedder == "policy" else ""
    space = embedding_space(cfg.embedder, namespace)  # centroids.embedder holds it, as embeddings.embedder does
    x, fresh = cached_embeddings(store, candidates.frame.select("prompt_id", "text"), cfg.embedder, backend,
                                 namespace)
    prev = (this_round(store, "centroids", ctx.run_id, ctx.round - 1).filter(pl.col("embedder") == space)
            .sort("cluster").collect())
    init = np.asarray(prev["vector"].to_list(), np.float32) if prev.height else None
    return replace(candidates, x=x, space=space, init=init), {"embedded": fresh, "embedding_space": space}


def this_rows(frame: pl.DataFrame, ctx: RoundContext, name: str) -> pl.DataFrame:
    """A selector's rows with the round's run_id and round, and the selector's name."""
    return frame.with_columns(pl.lit(ctx.run_id).alias("run_id"), pl.lit(ctx.round, pl.Int32).alias("round"),
                              pl.lit(name).alias("selector"))
