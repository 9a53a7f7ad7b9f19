"""Intervals for comparing arms over seeds and prompts (docs/algorithms.md, comparison).

The data of one arm is a matrix x[s, p]: held-out pass@1 of prompt p in the run with seed s (every run of a
comparison holds out the same prompts, so columns line up across arms and seeds). The estimate is the grand
mean. Its uncertainty has two sources, the seeds (training randomness) and the prompts (which questions the
held-out set happens to hold), so the bootstrap resamples both: each replicate draws S seeds and P prompts
with replacement and takes the mean of the drawn rows and columns (a two-way bootstrap; prompts drawn once
per replicate and shared by its seeds, since the same prompts are evaluated in every run). The interval is
the percentile interval of B replicates (B = 2000, 95% by default), seeded, so a report is reproducible.

A paired difference between two arms resamples the same seeds and prompts for both (seed s of one arm is
paired with seed s of the other), so what the arms share (a hard prompt, a lucky seed) cancels and the
interval is narrower than the two separate ones suggest. With one seed, only prompts are resampled, and the
interval says nothing about training randomness; `seeds` in the result says how many there were.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

N_BOOT = 2000
LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    seeds: int
    prompts: int


def _matrix(x) -> np.ndarray:
    m = np.asarray(x, dtype=float)
    if m.ndim != 2 or m.shape[0] < 1 or m.shape[1] < 1:
        raise ValueError(f"expected a [seeds, prompts] matrix with at least one of each, got shape {m.shape}")
    if not np.isfinite(m).all():
        raise ValueError("the matrix holds a missing or non-finite value: every run must evaluate every prompt")
    return m


def _replicates(diff: np.ndarray, n_boot: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    s, p = diff.shape
    rows = rng.integers(0, s, size=(n_boot, s))
    cols = rng.integers(0, p, size=(n_boot, p))
    # the mean over drawn rows x drawn columns is a weighted mean: each row and column counted as often as drawn
    row_w = np.stack([np.bincount(r, minlength=s) for r in rows])
    col_w = np.stack([np.bincount(c, minlength=p) for c in cols])
    return np.einsum("bs,sp,bp->b", row_w, diff, col_w) / (s * p)


def _interval(m: np.ndarray, n_boot: int, level: float, seed: int) -> Interval:
    reps = _replicates(m, n_boot, seed)
    tail = (1 - level) / 2
    lo, hi = np.quantile(reps, [tail, 1 - tail])
    return Interval(float(m.mean()), float(lo), float(hi), m.shape[0], m.shape[1])


def bootstrap_mean(x, n_boot: int = N_BOOT, level: float = LEVEL, seed: int = 0) -> Interval:
    """The grand mean of x[seed, prompt] with its two-way bootstrap interval."""
    return _interval(_matrix(x), n_boot, level, seed)


def paired_difference(a, b, n_boot: int = N_BOOT, level: float = LEVEL, seed: int = 0) -> Interval:
    """mean(a) - mean(b) for two arms' x[seed, prompt] matrices of one shape, seeds and prompts paired."""
    a, b = _matrix(a), _matrix(b)
    if a.shape != b.shape:
        raise ValueError(f"paired arms need the same seeds and prompts: shapes {a.shape} and {b.shape}")
    return _interval(a - b, n_boot, level, seed)
