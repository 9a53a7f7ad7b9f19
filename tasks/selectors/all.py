"""`all`: the round collects for its whole active pool (and reserve, with rollout.include_reserve): no select
stage runs (`whole_pool`), so a round lands no `selections`; the collect stage reads the pool instead
(tasks/sampling/rollouts.py `round_prompts`). The sampler API, which draws batches, refuses it."""

from __future__ import annotations

from tasks.selectors.base import Candidates, Picks, RoundView, Selector, Settings, pick_rows, register


@register
class All(Selector):
    name = "all"
    description = "the whole active pool (no select stage)"
    whole_pool = True

    def select(self, candidates: Candidates, view: RoundView, cfg: Settings) -> Picks:
        """Every candidate (for a caller that runs the select stage anyway; the flow does not)."""
        return Picks(pick_rows(candidates.ids, "all: the whole pool"))
