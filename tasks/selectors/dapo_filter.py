"""`dapo_filter`: DAPO dynamic sampling (Yu et al. 2025, arXiv 2503.14476 §3.2; tasks/core/dapo.py), the baseline
that filters by generating. The select stage picks generation batch 1, the first ceil(factor * B) of a seeded
uniform draw order over the candidates (tasks/core/selection.py `select_dapo_filter`), whatever they scored
before, as DAPO draws from the whole dataset. It `generates`: the collect stage generates the batch, drops the
groups with no reward variance and refills from the same draw order until B groups have variance or
`dapo_max_batches` is reached (tasks/sampling/dynamic.py); the discards land in `discarded_rollouts` and the
refills in `selections`.

The over-sampling factor is made fair (docs/algorithms.md §7): 1 / the run's last round's informative ratio
(`last_informative_ratio`: groups whose rewards differ over all groups generated, kept and discarded), capped
at 3 (tasks/core/dapo.py `adaptive_oversample`); round 0 uses `dapo_oversample`. The select and collect summaries
record the factor used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import polars as pl

from storage.query import scan
from tasks.core.dapo import adaptive_oversample
from tasks.core.eps import own_samples
from tasks.core.selection import select_dapo_filter
from tasks.selectors.base import Candidates, Picks, RoundView, Selector, Settings, register

if TYPE_CHECKING:
    from storage.store import Store


def last_informative_ratio(store: Store, run_id: str, round: int, tol: float = 1e-6) -> float | None:
    """Of the groups run `run_id` generated in round `round` - 1 (rollouts and discarded_rollouts, the policy's
    own samples), the share whose rewards differ; None in round 0 or when that round generated none."""
    if round < 1:
        return None
    last = (pl.col("run_id") == run_id) & (pl.col("round") == round - 1)
    frames = [scan(store, t).filter(last).select("prompt_id", "reward", "augmentation").collect()
              for t in ("rollouts", "discarded_rollouts")]
    rows = pl.concat(frames)
    if rows.height == 0:
        return None
    groups = own_samples(rows).group_by("prompt_id").agg(s=pl.col("reward").std(ddof=0)).collect()
    return float((groups["s"].fill_null(0.0) > tol).mean())


@register
class DapoFilter(Selector):
    name = "dapo_filter"
    description = ("DAPO dynamic sampling (over-sample by 1 / last round's informative ratio, capped at 3, drop "
                   "groups with no reward variance, refill to B; the discards land in discarded_rollouts)")
    generates = True

    def select(self, candidates: Candidates, view: RoundView, cfg: Settings) -> Picks:
        ratio = last_informative_ratio(view.store, view.ctx.run_id, view.ctx.round)
        factor = adaptive_oversample(ratio, cfg.dapo_oversample)
        rows = select_dapo_filter(candidates.ids, cfg.batch_size, factor, view.seed)
        return Picks(rows, summary={"batch_size": cfg.batch_size, "oversample": factor,
                                    "last_informative_ratio": ratio})
