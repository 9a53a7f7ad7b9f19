"""Screening, then top-up (issue 50 item 2; SPEED-RL's screen-then-complete, with the pass-rate posterior of
tasks/core/passrate.py deciding the unanimous screens; docs/algorithms.md §4.2): the pure decisions, no backend,
no store. The collect stage's loop is tasks/sampling/screening.py.

Method. Each candidate first gets k_s screening samples (default 2 of G). Then:
- a **mixed** screen (its rewards differ) is topped up to G: it is informative whatever the rest says, and its
  screening samples are part of the group;
- a **unanimous** screen is topped up only if the posterior says the full group is still likely mixed: with the
  prompt's Beta posterior updated by the screen (α', β'), the full group is mixed iff the G − k_s top-up samples
  are not all like the screen, so P(informative) = 1 − E[(1 − p)^(G−k_s)] after an all-fail screen and
  1 − E[p^(G−k_s)] after an all-pass one (the closed form of `p_informative`, one side of it); top up when it
  is >= `threshold`;
- otherwise the screen's k_s samples are all the prompt gets this round (`screened_out`).

Choices, and why:
- Default threshold 0.7 **(ours, measured)**. The break-even argument gives 0.5: a top-up costs G − k_s samples
  and yields P(informative) groups, 0.5 · G / (G − k_s) ≈ 0.67 informative groups per G samples at G = 8,
  k_s = 2, about what plain rollouts yield. But the posterior is over-confident in that band: it pools a bin's
  prompts as one Beta, while a bin's prompts differ (some always fail, some always pass), so a bin passing 35%
  of the time predicts P ≈ 0.8 for a prompt that failed twice although that prompt is often one that never
  passes. Measured on the embedded policy (round 0 of the evidence design's pool, B = 48, G = 8, 2 seeds;
  `python benchmarks/screening.py --seed S`): at 0.5, 73 and 97 posterior top-ups of which 54 and 72 came out
  all-equal, 2.05 and 1.64 informative groups per 1k collect tokens, no better than no screening (1.46,
  1.97); at 0.7, 15 and 34 top-ups (4 and 10 all-equal), 3.00 and 3.04; at 0.9 and 1.0 (seed 0) 2.74 and
  2.58, fewer groups kept (short by 6 and 9).
- The posterior (α', β') is the caller's: tasks/sampling/screening.py pools the run's earlier groups and every
  screen of the round so far, so a bin's unanimous screens in round 0 already teach its other members.
- Refills are ordered by a prediction that costs no tokens (`refill_order`): one Thompson draw per candidate,
  keyed by (round seed, prompt) as the `thompson` selector draws (tasks/core/passrate.py `thompson_draws`),
  scored by P(a group of G is mixed | the draw), best first, ties by prompt id.
- Or by that order inside each pass-rate bin, the bins interleaved at their share of the candidates
  (`stratified`, `rollout.screen_refill = "stratified"`): every prefix of the queue holds each bin at its share
  (within one prompt for up to three bins; see `stratified`), as a uniform draw does on average. Why: best
  first across bins fills the batch from the bins whose pass rate is nearest one half. In issue 50's decision
  run (docs/evidence-v3.md, 8 seeds) that moved the default's informative groups off two-digit sums (30% of them
  against uniform's 51%; the bin is half the held-out set) onto one-digit products (17% against 11%): it gained
  on the latter (held-out 0.930 against 0.790) and lost on the former (0.322 against 0.361). Stratified, the
  posterior still picks which prompts of a bin to screen first, and screening still drops a bin's unanimous
  screens, so the kept groups stay tilted by each bin's informative share, but no longer by the queue's order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tasks.core.passrate import p_informative_at, thompson_draws

MIXED = "mixed"  # the screen's rewards differ: topped up
POSTERIOR = "posterior"  # unanimous, topped up because the posterior says the group is likely mixed
SCREENED = "screened_out"  # unanimous and unlikely to be mixed: the screen is all the prompt gets


@dataclass(frozen=True)
class ScreenDecision:
    """What to do with one screened candidate: `why` is MIXED, POSTERIOR or SCREENED; `p_informative` is the
    posterior probability that the full group is mixed (1 for a mixed screen)."""

    why: str
    p_informative: float

    @property
    def topup(self) -> bool:
        return self.why != SCREENED


def p_group_informative(alpha: np.ndarray, beta: np.ndarray, passed: np.ndarray, remaining: int) -> np.ndarray:
    """P(the full group is mixed | a unanimous screen): the `remaining` top-up samples are not all like the screen
    (all correct if `passed`, else all wrong), under Beta(α, β), the posterior that already holds the screen.

    >>> p_group_informative(np.array([1.0]), np.array([5.0]), np.array([False]), 6).round(4).tolist()  # 1 - 5/11
    [0.5455]
    >>> p_group_informative(np.array([7.0, 2.0]), np.array([1.0, 2.0]), np.array([True, True]), 0).tolist()
    [0.0, 0.0]
    """
    a, b = np.asarray(alpha, float)[:, None], np.asarray(beta, float)[:, None]
    same = np.where(np.asarray(passed, bool)[:, None], a, b)  # the side the top-up must leave to be mixed
    j = np.arange(remaining, dtype=float)[None, :]
    log_all_same = (np.log(same + j) - np.log(a + b + j)).sum(axis=1)
    return np.clip(-np.expm1(log_all_same), 0.0, 1.0) + 0.0  # + 0.0: no top-up left reads 0.0, not -0.0


def screen_decisions(mixed: Sequence[bool], passed: Sequence[bool], alpha: np.ndarray, beta: np.ndarray,
                     remaining: int, threshold: float) -> list[ScreenDecision]:
    """One decision per screened candidate (see the module docstring). `mixed[i]`: the screen's rewards differ;
    `passed[i]`: a unanimous screen was all correct; (α_i, β_i): the posterior holding the screen; `remaining`:
    G − k_s.

    >>> [d.why for d in screen_decisions([True, False, False], [False, False, False], np.array([1.0, 1, 1]),
    ...                                   np.array([9.0, 5, 9]), 6, 0.5)]
    ['mixed', 'posterior', 'screened_out']
    """
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"the screening top-up threshold must be in [0, 1], got {threshold}")
    if not len(mixed) == len(passed) == len(alpha) == len(beta):
        raise ValueError(f"{len(mixed)} screens need as many outcomes and posteriors, got {len(passed)}, "
                         f"{len(alpha)} and {len(beta)}")
    p = p_group_informative(alpha, beta, np.asarray(passed, bool), remaining) if len(mixed) else np.zeros(0)
    return [ScreenDecision(MIXED, 1.0) if m else ScreenDecision(POSTERIOR if q >= threshold else SCREENED, float(q))
            for m, q in zip(mixed, p)]


def refill_order(ids: Sequence[str], alpha: np.ndarray, beta: np.ndarray, seed: int, round: int,
                 group_size: int, bins: Sequence[str] | None = None) -> list[str]:
    """`ids` best first by P(a group of G is mixed | one Thompson draw keyed by (round seed, prompt)), ties by
    prompt id: the order refills screen the round's further candidates in. With `bins` (one per id), that
    order inside each bin, the bins interleaved at their shares (`stratified`)."""
    if not len(ids):
        return []
    score = p_informative_at(thompson_draws(list(ids), alpha, beta, seed, round), group_size)
    order = [ids[i] for i in np.lexsort((np.array(ids, dtype=object), -score))]
    if bins is None:
        return order
    if len(bins) != len(ids):
        raise ValueError(f"stratified refills: {len(ids)} candidates need as many bins, got {len(bins)}")
    return stratified(order, dict(zip(ids, bins)))


def stratified(order: Sequence[str], bin_of: dict[str, str]) -> list[str]:
    """`order` interleaved across bins at each bin's share of it, keeping the order inside each bin: the item of
    rank r (from 0) among its bin's n goes to position key (r + 1/2) / n, ties by bin then position. A prefix
    ending at key t holds round(t · n_b) of bin b (an exact tie either way), so its count of b is off its share
    of the prefix by e_b − s_b · Σ_c e_c with every |e_c| <= 1/2: by less than one item with up to three bins,
    by at most (K − 1)/2 with K bins.

    >>> stratified(["a1", "a2", "a3", "a4", "b1", "b2"], {"a1": "a", "a2": "a", "a3": "a", "a4": "a", "b1": "b",
    ...                                                   "b2": "b"})
    ['a1', 'b1', 'a2', 'a3', 'b2', 'a4']
    """
    size = Counter(bin_of[i] for i in order)
    rank: dict[str, int] = {}
    keyed = []
    for pos, i in enumerate(order):
        b = bin_of[i]
        r = rank[b] = rank.get(b, -1) + 1
        keyed.append(((r + 0.5) / size[b], b, pos, i))
    return [i for *_, i in sorted(keyed)]
