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

`token_exchange` puts a paired pair of runs on one scale, generated tokens: the lower of the two runs' mean
held-out pass@1 at the budget, and the tokens each run first reached it with, on the piecewise-linear curve
through its checkpoints. The ratio (the base's tokens over the arm's for that pass@1) is above 1 when the arm
learns with fewer tokens: 2.0 is "the arm reached the base's figure with half the tokens", as the field states
sample efficiency. It needs no checkpoint past the budget, so the evidence protocol's runs give it as they
stand; it is not "what the base would need to match the arm's figure" (that needs the base's runs past the
budget); between milestones it is as coarse as the milestones are.
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


def tokens_to_reach(costs, curve, target: float) -> float | None:
    """The first cost at which the piecewise-linear `curve` (one value per checkpoint, at `costs`) reaches
    `target`; None if it never does.

    >>> tokens_to_reach([0, 20, 40], [0.2, 0.4, 0.5], 0.45)
    30.0
    >>> tokens_to_reach([0, 20, 40], [0.2, 0.4, 0.5], 0.6) is None
    True
    """
    c = np.asarray(costs, dtype=float)
    y = np.asarray(curve, dtype=float)
    if c.shape != y.shape or c.ndim != 1 or c.size == 0:
        raise ValueError(f"expected one value per checkpoint, got costs {c.shape} and curve {y.shape}")
    for i in range(c.size):
        if y[i] >= target:
            if i == 0 or y[i] == y[i - 1]:
                return float(c[i])
            return float(c[i - 1] + (target - y[i - 1]) / (y[i] - y[i - 1]) * (c[i] - c[i - 1]))
    return None


def token_exchange(arm_costs, arm_pass1, base_costs, base_pass1, budget: float) -> float | None:
    """The base run's generated tokens over the arm's for the same mean pass@1 (module docstring): the lower of
    the two runs' figures at `budget`, and each run's first crossing of it, so a run against itself reads 1.0
    and the two sides of "at or below" meet without a jump. `*_pass1`: [checkpoints, prompts]. None when a run
    did not reach the budget, the budget is 0 (nothing generated), or both runs had that figure at their first
    checkpoint (no tokens on either side: nothing learned to compare); inf when only the base had it there.

    >>> token_exchange([0, 20, 40], [[0.2], [0.4], [0.5]], [0, 20, 40], [[0.2], [0.3], [0.4]], 40)
    2.0
    >>> token_exchange([0, 20, 40], [[0.2], [0.3], [0.4]], [0, 20, 40], [[0.2], [0.4], [0.5]], 40)
    0.5
    """
    if budget <= 0:
        return None
    arm_curve = np.asarray(arm_pass1, dtype=float).mean(axis=1)  # a run's mean pass@1 per checkpoint
    base_curve = np.asarray(base_pass1, dtype=float).mean(axis=1)
    a, b = at_budget(arm_costs, arm_curve[:, None], budget), at_budget(base_costs, base_curve[:, None], budget)
    if a is None or b is None:
        return None
    level = min(float(a[0]), float(b[0])) - 1e-12  # a crossing computed by another formula, within rounding
    t_arm, t_base = tokens_to_reach(arm_costs, arm_curve, level), tokens_to_reach(base_costs, base_curve, level)
    if t_arm is None or t_base is None or (t_arm == 0 and t_base == 0):
        return None
    return t_base / t_arm if t_arm else float("inf")


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
