"""A token budget's last round, fitted to what is left of it (issue 50: the round that crossed the budget ran
to its end, so budgeted runs overshot by up to a round: 61-65k tokens for a 60k budget, and an arm with
bigger rounds overshot more).

Method. A round's generated tokens grow with its batch B (the select stage's picks: screening's refills and
DAPO's over-sampling are sized from it), so the round before tells what a pick costs: its counted tokens
over its batch. Before round r, with `left = budget - spent`, a round whose full batch would cost more than
`left` selects round(left / cost per pick) prompts instead, and is the run's last; a round that would select
0 (what is left buys less than half a pick) does not run. Round 0 has no round before it and selects B.

Choices, and why:
- round(), not floor(): the expected overshoot is centred on zero (half a pick's tokens either way, plus the
  round's own noise) instead of always falling short.
- A fitted round is the last even if it comes in under the budget, so a run never ends in a dribble of
  one-prompt rounds, each paying for its own evaluation and report.
- The batches are recomputed from the stored tokens of every round (pure: `fitted_batches`), so a resumed run
  fits the same round alike. A resume that changes the budget recomputes the earlier rounds' batches under
  the new one: a fitted round recomputed as B makes the next round's cost per pick read low, and a raise
  smaller than the rest of a round can leave the old last round last (the run then stops with tokens left).
  The divisor is the batch asked for, not the picks landed: a pool with fewer active prompts than B makes a
  pick read cheap, and the fitted round overshoots as rounds did before.
- A full round that ends within half a pick of the budget leaves the next 0: the flow evaluates it as the
  run's end (flows/curriculum.py `budget_ends`).
- The cost of the previous round alone, not a mean over the run: rounds get cheaper as completions shorten
  (26 -> 13 tokens on SmolLM2-135M), so older rounds would overstate it.
"""

from __future__ import annotations

from typing import NamedTuple


class Fit(NamedTuple):
    batch: int  # the round's picks: B, fewer in the budget's last round, 0 for a round that does not run
    last: bool  # the budget's last round: no round follows it


def fitted_batches(round_tokens: list[int], budget: int, batch: int) -> list[Fit]:
    """The fit of rounds 0..n given the counted tokens of rounds 0..n-1 (`round_tokens`): B until the budget's
    last round, which gets round(left / cost per pick) (module docstring). A round after the last, or once
    the budget is reached, gets Fit(0, True).

    >>> [f.batch for f in fitted_batches([4800, 4600], 12_000, 48)]  # 2,600 left at 4600/48 = 95.8 per pick
    [48, 48, 27]
    >>> fitted_batches([4800, 4600, 2580], 12_000, 48)[2:]  # round 2 was the last: round 3 does not run
    [Fit(batch=27, last=True), Fit(batch=0, last=True)]
    >>> fitted_batches([], 12_000, 48), fitted_batches([4800], 100_000, 48)
    ([Fit(batch=48, last=False)], [Fit(batch=48, last=False), Fit(batch=48, last=False)])
    """
    if budget < 1 or batch < 1:
        raise ValueError(f"a token budget needs a positive size and batch, not budget {budget}, batch {batch}")
    fits = [Fit(batch, False)]
    spent = 0
    for tokens in round_tokens:
        previous = fits[-1]
        spent += tokens
        left = budget - spent
        if previous.last or left <= 0:  # the last round ran (fitted, or it reached the budget)
            fits.append(Fit(0, True))
            continue
        per_pick = tokens / previous.batch
        if per_pick <= 0 or per_pick * batch <= left:
            fits.append(Fit(batch, False))
        else:
            picks = min(batch, int(left / per_pick + 0.5))
            fits.append(Fit(picks, True))
    return fits
