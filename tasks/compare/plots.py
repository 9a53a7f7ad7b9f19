"""The curves of docs/evidence.md: held-out pass@1 against generated tokens, optimizer steps and wall-clock
seconds, one line per arm (the mean over its seeds, at budgets every seed reached; on the token axis of runs
evaluated at milestones, at the milestones every seed has) with its 95% two-way
bootstrap band (tasks/core/stats.py, fewer replicates per point than the tables use). Matplotlib's Agg canvas
on `Figure` objects, without pyplot, as tasks/reporting/plots.py does.
"""

from __future__ import annotations

import numpy as np

from tasks.compare.figures import AXES, arm_at
from tasks.compare.page import Evidence
from tasks.core.stats import bootstrap_mean

CURVE_POINTS = 30
CURVE_BOOT = 500  # replicates per curve point (the tables use stats.N_BOOT)


def curve(ev: Evidence, arm: str, axis: str, points: int = CURVE_POINTS):
    """(budgets, means, lows, highs) of an arm's pass@1 on a grid up to its runs' smallest last cost."""
    mine = [ev.curves[i] for i in ev.by_arm[arm]]
    top = min(c.last(axis) for c in mine)
    xs, ms, lo, hi = [], [], [], []
    marks = [{m for m in c.milestones if m is not None} for c in mine]
    # evaluated at milestones: the points are the milestones every run has (no line drawn inside a round)
    grid = sorted(set.intersection(*marks)) if axis == "tokens" and all(marks) else np.linspace(0.0, top, points)
    for b in grid:
        x = arm_at(mine, axis, float(b))
        if x is None:
            continue
        iv = bootstrap_mean(x, n_boot=CURVE_BOOT)
        xs.append(float(b)), ms.append(iv.mean), lo.append(iv.low), hi.append(iv.high)
    return xs, ms, lo, hi


def plots(ev: Evidence) -> dict:
    """One Figure per axis: pass@1 against the axis, a line and a 95% band per arm."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figs = {}
    for axis, label in AXES.items():
        fig = Figure(figsize=(8.5, 5.0), dpi=100, layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        for f in ev.arms:
            xs, ms, lo, hi = curve(ev, f.arm, axis)
            style = "--" if f.arm.startswith("no_") else "-"
            (line,) = ax.plot(xs, ms, style, label=f"{f.arm} ({len(f.seeds)} seed{'s' * (len(f.seeds) > 1)})")
            if len(f.seeds) > 1 or not f.arm.startswith("no_"):
                ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15)
        ax.axvline(ev.budgets[axis], color="#6c757d", lw=0.8, ls=":")
        ax.set(xlabel=f"cumulative {label}", ylabel="held-out pass@1",
               title=f"held-out pass@1 against {label} (band: 95% bootstrap over seeds and prompts)")
        ax.legend(fontsize=8, loc="best")
        figs[f"pass1_vs_{axis}"] = fig
    return figs
