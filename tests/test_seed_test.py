"""The seed-level decision of a comparison (tasks/core/seed_test.py): the exact sign-flip p, the t-interval and
the power line, each against an independent computation."""

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from tasks.core.seed_test import MIN_SEEDS_FOR_5PCT, seed_differences, seeds_needed, sign_flip_p, t_interval


def test_seed_differences_pair_rows_by_seed():
    a = np.array([[1.0, 0.0], [1.0, 1.0]])
    b = np.array([[0.0, 0.0], [1.0, 0.0]])
    assert seed_differences(a, b).tolist() == [0.5, 0.5]
    with pytest.raises(ValueError, match="one shape"):
        seed_differences(a, b[:1])


def test_sign_flip_p_equals_a_brute_force_count():
    d = np.array([0.08, -0.02, 0.05, 0.11, 0.03, -0.01, 0.07])
    count = sum(abs(np.dot(s, d)) >= abs(d.sum()) - 1e-12 for s in itertools.product((1, -1), repeat=d.size))
    assert sign_flip_p(d) == count / 2 ** d.size
    assert sign_flip_p(-d) == sign_flip_p(d)  # two-sided


def test_four_seeds_can_never_decide_at_five_percent_and_six_can():
    assert sign_flip_p([0.2, 0.3, 0.25, 0.1]) == 0.125
    assert sign_flip_p([0.2] * 6) == pytest.approx(2 / 64) and 2 / 64 < 0.05
    assert MIN_SEEDS_FOR_5PCT == 6


def test_sampled_flips_above_sixteen_seeds_agree_with_the_t_test_roughly():
    d = np.random.default_rng(1).normal(0.02, 0.05, size=24)
    p = sign_flip_p(d, seed=3)
    assert abs(p - stats.ttest_1samp(d, 0).pvalue) < 0.05


def test_t_interval_is_scipys():
    d = np.array([0.05, 0.01, 0.09, -0.02, 0.04])
    m, lo, hi = t_interval(d)
    ref = stats.t.interval(0.95, d.size - 1, loc=d.mean(), scale=stats.sem(d))
    assert (lo, hi) == pytest.approx(ref) and m == pytest.approx(d.mean())
    assert all(math.isnan(x) for x in t_interval([0.1])[1:])


def test_seeds_needed_gives_the_power_it_promises():
    """Simulated paired t-tests at the returned seed count reject about 80% of the time, and one seed fewer
    does not reach it (when above the sign-flip minimum)."""
    sd, effect = 0.06, 0.04
    n = seeds_needed(sd, effect)
    rng = np.random.default_rng(0)

    def power(k: int) -> float:
        d = rng.normal(effect, sd, size=(4000, k))
        return float((stats.ttest_1samp(d, 0, axis=1).pvalue < 0.05).mean())

    assert n > MIN_SEEDS_FOR_5PCT
    assert power(n) >= 0.78 and power(n - 1) < 0.80
    assert seeds_needed(sd, 2 * effect) < n < seeds_needed(2 * sd, effect)
    with pytest.raises(ValueError):
        seeds_needed(float("nan"), 0.1)
