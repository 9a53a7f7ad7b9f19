"""The decision between two arms: a seed-level paired test, stated before the runs (issue 49, item 4).

Why seeds, not prompts. In the evidence runs the seed-to-seed spread of a paired difference (0.037-0.078) is
several times the prompt part of its standard error (about 0.013): training randomness binds. The two-way
bootstrap (tasks/core/stats.py) describes both sources, but with 3 seeds it has only 10 distinct seed multisets
and its percentile interval understates the seed part. So the decision is taken on the seeds alone:

- d_s = mean over held-out prompts of arm A's pass@1 minus arm B's, for each paired seed s (seed s of A and of B
  share draws: tasks/core/seeds.py);
- the test: an exact two-sided sign-flip permutation test over the S seeds (all 2^S sign patterns; the null is
  that d_s is symmetric around 0). It assumes nothing about the shape of d's distribution. Its smallest possible
  p is 2 / 2^S: with 4 seeds 0.125, so 4 seeds can never decide at 5%; 6 seeds can (0.031), 8 comfortably
  (0.0078). Above 16 seeds the 2^S patterns are sampled (65,536 draws, seeded) instead of enumerated;
- beside it, the t-interval mean(d) +/- t_{S-1, 0.975} sd(d) / sqrt(S) (the interval the bootstrap understates);
- the power line: the number of paired seeds a two-sided paired t-test at 5% needs for 80% power to detect an
  effect of `effect` (e.g. +10% of the baseline's pass@1) when the seed-level spread is the observed sd(d)
  (the noncentral t), and at least the 6 the sign-flip test needs to reach 5% at all.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

EXACT_UP_TO = 16  # seeds: above this, sign patterns are sampled
SAMPLED_FLIPS = 65_536
MIN_SEEDS_FOR_5PCT = 6  # the sign-flip test's smallest p, 2 / 2^S, is below 0.05 from S = 6


def seed_differences(a, b) -> np.ndarray:
    """d_s: the per-seed difference of mean pass@1 over prompts, from two [seeds, prompts] matrices whose rows
    are paired by seed and whose columns are the same prompts."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.ndim != 2 or a.shape != b.shape:
        raise ValueError(f"paired matrices must have one shape [seeds, prompts], got {a.shape} and {b.shape}")
    return a.mean(axis=1) - b.mean(axis=1)


def sign_flip_p(d, seed: int = 0) -> float:
    """Two-sided p of the sign-flip permutation test of mean(d) = 0: the share of sign patterns whose |mean| is
    at least the observed one (the observed pattern included, so p >= 2 / 2^S for S seeds).

    >>> sign_flip_p([0.1, 0.2, 0.15, 0.05]), sign_flip_p([0.1] * 8)
    (0.125, 0.0078125)
    """
    d = np.asarray(d, dtype=float)
    if d.size == 0:
        raise ValueError("a sign-flip test needs at least one paired seed")
    observed = abs(d.mean()) - 1e-12
    if d.size <= EXACT_UP_TO:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=d.size)))
    else:
        signs = np.random.default_rng(seed).choice((1.0, -1.0), size=(SAMPLED_FLIPS, d.size))
        signs[0] = 1.0
    return float((np.abs(signs @ d / d.size) >= observed).mean())


def t_interval(d, level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the t-interval of mean(d) over seeds; (mean, nan, nan) with one seed."""
    from scipy import stats

    d = np.asarray(d, dtype=float)
    m = float(d.mean())
    if d.size < 2:
        return m, math.nan, math.nan
    half = stats.t.ppf(0.5 + level / 2, d.size - 1) * d.std(ddof=1) / math.sqrt(d.size)
    return m, m - half, m + half


def seeds_needed(sd: float, effect: float, alpha: float = 0.05, power: float = 0.8, at_most: int = 1000) -> int:
    """Paired seeds a two-sided paired t-test at `alpha` needs for `power` against a true mean difference
    `effect` when seed-level differences spread with standard deviation `sd`; never fewer than the sign-flip
    test's minimum. `at_most` + 1 when even `at_most` seeds fall short.

    >>> seeds_needed(0.05, 0.05), seeds_needed(0.0, 0.05), seeds_needed(0.05, 0.0)
    (10, 6, 1001)
    """
    from scipy import stats

    if sd < 0 or not math.isfinite(sd) or not math.isfinite(effect):
        raise ValueError(f"seeds_needed needs a finite sd >= 0 and a finite effect, got sd={sd}, effect={effect}")
    if effect == 0:
        return at_most + 1
    if sd == 0:
        return MIN_SEEDS_FOR_5PCT
    for n in range(2, at_most + 1):
        crit = stats.t.ppf(1 - alpha / 2, n - 1)
        nc = abs(effect) / (sd / math.sqrt(n))
        achieved = stats.nct.sf(crit, n - 1, nc) + stats.nct.cdf(-crit, n - 1, nc)
        if achieved >= power:
            return max(n, MIN_SEEDS_FOR_5PCT)
    return at_most + 1
