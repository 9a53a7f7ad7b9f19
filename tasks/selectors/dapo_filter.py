"""`dapo_filter`: DAPO dynamic sampling (Yu et al. 2025, arXiv 2503.14476 §3.2; tasks/core/dapo.py), the baseline
that filters by generating. The select stage picks generation batch 1, the first ceil(dapo_oversample * B) of a
seeded uniform draw order over the candidates (tasks/core/selection.py `select_dapo_filter`), whatever they
scored before, as DAPO draws from the whole dataset. It `generates`: the collect stage generates the batch,
drops the groups with no reward variance and refills from the same draw order until B groups have variance or
`dapo_max_batches` is reached (tasks/sampling/dynamic.py); the discards land in `discarded_rollouts` and the
refills in `selections`.
"""

from __future__ import annotations

from tasks.core.selection import select_dapo_filter
from tasks.selectors.base import Candidates, Picks, RoundView, Selector, Settings, register


@register
class DapoFilter(Selector):
    name = "dapo_filter"
    description = ("DAPO dynamic sampling (over-sample, drop groups with no reward variance, refill to B; the "
                   "discards land in discarded_rollouts)")
    generates = True

    def select(self, candidates: Candidates, view: RoundView, cfg: Settings) -> Picks:
        rows = select_dapo_filter(candidates.ids, cfg.batch_size, cfg.dapo_oversample, view.seed)
        return Picks(rows, summary={"batch_size": cfg.batch_size, "oversample": cfg.dapo_oversample})
