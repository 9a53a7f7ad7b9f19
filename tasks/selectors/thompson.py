"""`thompson`: predict before generating (issue 50, item 1; the design's §4b rule). Each candidate's pass rate has
a Beta posterior pooled through its bin, updated from every group this run generated before the round (kept and
discarded rollouts alike: tasks/core/passrate.py); one Thompson draw per candidate scores P(a group of G is mixed
| the draw); the batch goes by that score, best first, with k-means
clusters of the embeddings keeping it diverse (no cluster takes more than twice its share of the candidates);
every non-empty bin keeps an exploration floor (3% of the batch, at least one), so a bin that only ever failed
is still drawn, at its floor.

What lands beside the picks: a `predictions` row for every candidate (picked or not) with its bin, posterior,
predicted pass rate, predicted P(informative) and draw; what happened is in the round's `prompt_scores`, so
the model's calibration is one SQL join (docs/algorithms.md §4b).

Choices: G is the group size of this run's groups so far (the mode of `prompt_scores.n`; 8 before any group
exists), since the select stage does not see the rollout section; the bins pool over every prompt this run has
generated for or may select, so a reserve or retired prompt's failures still teach its bin. The clusters are
fitted afresh each round (no warm start): only the share of the batch depends on them.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from storage.query import scan
from storage.rounds import prompts
from tasks.core.passrate import (
    p_informative,
    pass_counts,
    posterior,
    predicted_pass_rate,
    prompt_bins,
    thompson_draws,
    thompson_pick,
)
from tasks.core.selection import kmeans, n_clusters
from tasks.selectors.base import Candidates, Picks, RoundView, Selector, Settings, register

DEFAULT_G = 8
PRIOR_STRENGTH = 4.0
FLOOR_FRACTION = 0.03
DIVERSITY_CAP = 2.0  # no k-means cluster takes more than twice its share of the candidates


def run_history(view: RoundView) -> tuple[pl.DataFrame, int]:
    """The run's generated samples before this round (rollouts and discarded_rollouts) as pass counts, and G."""
    run, before = view.ctx.run_id, view.ctx.round
    earlier = (pl.col("run_id") == run) & (pl.col("round") < before)
    cols = ["prompt_id", "reward", "correct", "augmentation"]
    frames = [scan(view.store, t).filter(earlier).select(cols).collect() for t in ("rollouts", "discarded_rollouts")]
    counts = pass_counts(pl.concat(frames))
    n = scan(view.store, "prompt_scores").filter(earlier).select("n").collect()["n"]
    g = int(n.mode().sort()[-1]) if n.len() else DEFAULT_G
    return counts, g


def bins_of(store, ids: set[str]) -> pl.DataFrame:
    """(prompt_id, bin) of `ids` and of their roots (a child takes its difficulty from its root: passrate.py
    `prompt_bins`), from one read of the prompts table."""
    table = prompts(store, "source", "params", "meta", "transform", "root_id", "answer").collect()
    roots = table.filter(pl.col("prompt_id").is_in(list(ids)))["root_id"].drop_nulls().to_list()
    return prompt_bins(table.filter(pl.col("prompt_id").is_in(list(ids)) | pl.col("prompt_id").is_in(roots)))


@register
class Thompson(Selector):
    name = "thompson"
    description = "Thompson draws from each prompt's pooled Beta pass-rate posterior, by P(informative group), " \
                  "within k-means shares, with a 3% floor per bin"
    needs_embeddings = True

    def select(self, candidates: Candidates, view: RoundView, cfg: Settings) -> Picks:
        counts, g = run_history(view)
        ids = candidates.ids
        bins = bins_of(view.store, set(ids) | set(counts["prompt_id"].to_list()))
        every = posterior(bins, counts, PRIOR_STRENGTH, cfg.pass_rate_prior)
        post = pl.DataFrame({"prompt_id": ids}).join(every, on="prompt_id", how="left", maintain_order="left")
        x = candidates.x
        labels, _ = kmeans(x, n_clusters(len(ids), cfg.k_max), seed=view.seed, minibatch_above=cfg.minibatch_above)
        alpha, beta = post["alpha"].to_numpy(), post["beta"].to_numpy()
        draws = thompson_draws(ids, alpha, beta, view.seed, view.ctx.round)
        # by score across clusters, each capped at twice its share: a size-proportional share would make a
        # cluster of prompts that only ever failed give up its share from its worst members
        picks = thompson_pick(post.select("prompt_id", "alpha", "beta"), labels, post["bin"].to_list(),
                              cfg.batch_size, seed=view.seed, round=view.ctx.round, group_size=g,
                              floor_fraction=FLOOR_FRACTION, diversity_cap=DIVERSITY_CAP)
        chosen = set(picks["prompt_id"].to_list())
        predictions = pl.DataFrame({
            "prompt_id": ids, "bin": post["bin"], "alpha": alpha, "beta": beta,
            "predicted_pass_rate": predicted_pass_rate(alpha, beta),
            "predicted_informative": p_informative(alpha, beta, g),
            "draw": draws,
            "picked": [p in chosen for p in ids]})
        rows_out = picks.select("prompt_id", "cluster", pl.col("score").alias("weight"), "reason")
        floor = int(picks["reason"].str.starts_with("floor").sum())
        return Picks(rows_out, None, {"group_size": g, "bins": int(post["bin"].n_unique()), "floor_picks": floor,
                                      "predicted_informative_picked": round(float(np.mean(
                                          picks["predicted_informative"].to_numpy())) if picks.height else 0.0, 4)},
                     {"predictions": predictions})
