"""Held-out pass@1 of a run at a matched budget (docs/algorithms.md, comparison; docs/evidence.md).

A run is evaluated at each checkpoint v (v = 0 is the base model). Each checkpoint has a cost: the run's
cumulative generated tokens before it (rounds 0..v-1, evaluation excluded), its optimizer steps, or its
wall-clock seconds. Arms spend differently per round, so their checkpoints sit at different costs; to compare
them at equal cost the per-prompt pass@1 vector is interpolated linearly between the two checkpoints that
bracket the budget (the straight line between two measured policies; nothing is extrapolated: a budget past a
run's last checkpoint has no value). Interpolating each prompt keeps the [seeds, prompts] layout, so the
two-way bootstrap (tasks/core/stats.py) applies at any budget.

The matched budget of a comparison is the smallest last-checkpoint cost over its runs: the largest budget
every run reached. `area_under` summarises a whole curve up to a budget (issue 49, item 5): the trapezoid over
the measured checkpoints (milestones, where the run was evaluated at them) and the point at the budget, divided
by the budget, per prompt, so the same bootstrap applies to it.
"""

from __future__ import annotations

import numpy as np


def at_budget(costs, pass1, budget: float) -> np.ndarray | None:
    """Per-prompt pass@1 at `budget`, interpolated between checkpoints. `costs`: the checkpoints' costs,
    non-decreasing, starting at the base model's; `pass1`: [checkpoints, prompts]. None past the last
    checkpoint or before the first.

    >>> at_budget([0, 10, 30], [[0.0, 1.0], [0.5, 1.0], [1.0, 0.0]], 20).tolist()
    [0.75, 0.5]
    """
    c = np.asarray(costs, dtype=float)
    p = np.asarray(pass1, dtype=float)
    if c.ndim != 1 or p.ndim != 2 or p.shape[0] != c.size or c.size == 0:
        raise ValueError(f"expected costs [n] and pass1 [n, prompts], got {c.shape} and {p.shape}")
    if np.any(np.diff(c) < 0):
        raise ValueError(f"checkpoint costs must not decrease, got {c.tolist()}")
    if budget < c[0] or budget > c[-1]:
        return None
    hi = int(np.searchsorted(c, budget, side="left"))
    if c[hi] == budget:  # on a checkpoint (the last of equal-cost ones: the newest policy at that cost)
        return p[int(np.searchsorted(c, budget, side="right")) - 1].copy()
    lo = hi - 1
    w = (budget - c[lo]) / (c[hi] - c[lo])
    return (1 - w) * p[lo] + w * p[hi]


def matched_budget(last_costs) -> float:
    """The largest budget every run reached: the smallest of their last checkpoints' costs."""
    last = [float(x) for x in last_costs]
    if not last:
        raise ValueError("no runs to match")
    return min(last)



def area_under(costs, pass1, budget: float) -> np.ndarray | None:
    """Per-prompt area under the pass@1-cost curve from the first checkpoint to `budget`, by the trapezoid rule
    over the checkpoints up to it and the (interpolated) point at it, divided by the budget: a mean pass@1 over
    the budget, so 1.0 is a prompt solved from the start. None when the run did not reach `budget`.

    >>> area_under([0, 10, 30], [[0.0, 1.0], [0.5, 1.0], [1.0, 0.0]], 20).tolist()
    [0.4375, 0.875]
    """
    end = at_budget(costs, pass1, budget)
    if end is None or budget <= 0:
        return None
    c = np.asarray(costs, dtype=float)
    p = np.asarray(pass1, dtype=float)
    inside = c < budget
    xs = np.concatenate([c[inside], [budget]])
    ys = np.vstack([p[inside], end[None, :]])
    return np.trapezoid(ys, xs, axis=0) / budget
