"""tasks/core/stats.py: two-way bootstrap intervals cover the truth at about their level, pairing narrows a
difference's interval, and malformed matrices are refused."""

import numpy as np
import pytest

from tasks.core.stats import bootstrap_mean, paired_difference


def _arm(rng, difficulty, seed_effect, shift=0.0, n=8):
    """Pass@1 of P prompts over S seeds: each prompt's rate, moved by its seed, observed over n samples."""
    p = np.clip(difficulty[None, :] + seed_effect[:, None] + shift, 0, 1)
    return rng.binomial(n, p) / n


def test_the_interval_covers_the_true_mean_at_about_its_level():
    rng = np.random.default_rng(0)
    hits, trials = 0, 120
    for t in range(trials):
        # a fresh population each trial: prompts and seeds are samples, the truth is the population's mean
        difficulty = rng.uniform(0.1, 0.9, 60)
        seed_effect = rng.normal(0, 0.05, 3)
        x = _arm(rng, difficulty, seed_effect)
        iv = bootstrap_mean(x, n_boot=400, seed=t)
        hits += iv.low <= 0.5 <= iv.high  # difficulty ~ U(0.1, 0.9), seed effects ~ N(0, .05): mean 0.5
    assert 0.85 <= hits / trials <= 1.0, hits / trials


def test_pairing_cancels_what_the_arms_share():
    rng = np.random.default_rng(1)
    difficulty = rng.uniform(0.05, 0.95, 100)
    seed_effect = rng.normal(0, 0.05, 3)
    a = _arm(rng, difficulty, seed_effect, shift=0.05)
    b = _arm(rng, difficulty, seed_effect)
    d = paired_difference(a, b, seed=0)
    sa, sb = bootstrap_mean(a, seed=0), bootstrap_mean(b, seed=0)
    assert d.mean == pytest.approx(sa.mean - sb.mean)
    assert d.low > 0  # the +0.05 shift is detected once paired...
    assert (d.high - d.low) < 0.5 * ((sa.high - sa.low) + (sb.high - sb.low))  # ...with a far narrower interval
    assert (d.seeds, d.prompts) == (3, 100)


def test_constant_data_gives_a_point_and_bad_matrices_are_refused():
    iv = bootstrap_mean(np.full((2, 5), 0.25))
    assert (iv.mean, iv.low, iv.high) == (0.25, 0.25, 0.25)
    with pytest.raises(ValueError, match="same seeds and prompts"):
        paired_difference(np.zeros((2, 5)), np.zeros((3, 5)))
    with pytest.raises(ValueError, match="non-finite"):
        bootstrap_mean([[0.5, float("nan")]])
    with pytest.raises(ValueError, match="seeds, prompts"):
        bootstrap_mean([0.5, 0.2])
