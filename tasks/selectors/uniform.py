"""`uniform`: the batch drawn uniformly at random from the candidates, without replacement (the baseline
docs/algorithms.md §4 compares k-means selection against; tasks/core/selection.py `select_uniform`)."""

from __future__ import annotations

from tasks.core.selection import select_uniform
from tasks.selectors.base import Candidates, Picks, RoundView, Selector, Settings, register


@register
class Uniform(Selector):
    name = "uniform"
    description = "at random"

    def select(self, candidates: Candidates, view: RoundView, cfg: Settings) -> Picks:
        return Picks(select_uniform(candidates.ids, cfg.batch_size, view.seed))
