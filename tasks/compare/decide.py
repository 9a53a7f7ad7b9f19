"""What decides between two arms, beside the bootstrap that describes them (issue 49, items 3-5).

Per arm against the base arm (`uniform`), over the seeds both ran:
- the seed-level test stated before the runs (tasks/core/seed_test.py): d_s = arm minus base, mean held-out
  pass@1 at the matched token budget for each paired seed s; the exact sign-flip p over all 2^S sign patterns,
  the t-interval over seeds, and the power line: the paired seeds a test at 5% needs for 80% power against a
  +10% relative effect (0.10 x the base's pass@1 over the paired seeds) when seeds spread as the observed sd(d)
  (none with one seed: no spread to read);
- pass@1 at each budget of the design (e.g. 60k and 120k generated tokens), only where every run of the arm
  reached it: a budget past a run's last checkpoint is "not reached", never extrapolated;
- the area under its pass@1-generated-token curve up to the matched token budget (tasks/core/curves.py
  `area_under`: trapezoid over the measured checkpoints, per prompt, divided by the budget), with its paired
  interval against the base: a run that learns early scores higher than one that gets there at the end;
- matched steps and seconds per pair: the arm and the base over their paired seeds, each at the smaller of the
  two arms' reach on that axis (the smallest last cost over those runs), not at the reach of the slowest run of
  the whole comparison; seconds are generation and training only (tasks/compare/timing.py);
- the token exchange per paired seed (tasks/core/curves.py `token_exchange`): the base run's generated tokens
  over the arm's for the same mean pass@1, the lower of the pair's at the matched token budget (above 1: the
  arm needs fewer tokens);
- training tokens per run (`TRAINED`: the tokens the optimizer stepped on) beside generated tokens. Prefill
  tokens (prompts, few-shot turns, LoPE prefixes, MCMC contexts) are not recorded by the store
  (models/meter.py counts completions only), and the page says so rather than estimate them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tasks.compare.figures import arm_at
from tasks.core.curves import area_under, matched_budget, token_exchange
from tasks.core.seed_test import seed_differences, seeds_needed, sign_flip_p, t_interval
from tasks.core.stats import Interval, bootstrap_mean, paired_difference

RELATIVE_EFFECT = 0.10  # the power line's effect: +10% of the base arm's pass@1 (issue 49, item 4)
PAIR_AXES = {"steps": "optimizer steps", "work_seconds": "seconds of generation and training"}


@dataclass(frozen=True)
class SeedTest:
    seeds: list[int]
    d: list[float]  # per paired seed: arm minus base, mean pass@1 over the held-out prompts
    p: float  # exact two-sided sign-flip p
    t: tuple[float, float, float]  # (mean, low, high) t-interval over seeds; nan bounds with one seed
    base_mean: float  # the base arm's pass@1 over the paired seeds
    power_seeds: int | None  # paired seeds for 80% power at +10% relative; None with one seed

    @property
    def relative(self) -> float:
        return float(np.mean(self.d)) / self.base_mean if self.base_mean > 0 else float("nan")


@dataclass(frozen=True)
class PairMatch:
    axis: str
    budget: float
    arm: Interval
    base: Interval
    diff: Interval


@dataclass
class ArmDecision:
    arm: str
    paired_seeds: int
    test: SeedTest | None  # None for the base arm and an arm with no seed in common with it
    auc: Interval | None
    auc_diff: Interval | None
    at_design: dict[int, Interval | None] = field(default_factory=dict)  # design budget -> pass@1 (None: not reached)
    diff_design: dict[int, Interval | None] = field(default_factory=dict)
    pairs: dict[str, PairMatch | None] = field(default_factory=dict)  # axis -> matched with the base arm
    train_tokens: float = float("nan")  # mean per run
    exchange: list[float | None] = field(default_factory=list)  # per paired seed: base tokens / arm tokens

    @property
    def exchange_median(self) -> float | None:
        """The median token exchange over the paired seeds (None when no seed has one)."""
        known = [x for x in self.exchange if x is not None]
        return float(np.median(known)) if known else None


def seed_test(a, b, seeds: list[int], relative_effect: float = RELATIVE_EFFECT) -> SeedTest:
    """The seed-level test of arm a against base b, two [paired seeds, prompts] matrices at one budget."""
    d = seed_differences(a, b)
    base = float(np.asarray(b, dtype=float).mean())
    power = (seeds_needed(float(d.std(ddof=1)), relative_effect * base) if d.size >= 2 and base > 0 else None)
    return SeedTest(list(seeds), [float(x) for x in d], sign_flip_p(d), t_interval(d), base, power)


def area_matrix(curves, budget: float) -> np.ndarray | None:
    """[runs, prompts] normalised area under each run's pass@1-token curve up to `budget`; None if one fell short."""
    rows = [area_under(c.costs["tokens"], c.pass1, budget) for c in curves]
    return None if any(r is None for r in rows) else np.vstack(rows)


def pair_match(a_curves, b_curves, axis: str) -> PairMatch | None:
    """Two arms' paired runs (same order) at the smaller of their reaches on `axis`."""
    if not a_curves:
        return None
    budget = matched_budget(c.last(axis) for c in [*a_curves, *b_curves])
    a, b = arm_at(a_curves, axis, budget), arm_at(b_curves, axis, budget)
    return PairMatch(axis, budget, bootstrap_mean(a), bootstrap_mean(b), paired_difference(a, b))


def _both(read, a_c, b_c, *args):
    """`read` of both arms' paired runs; (None, None) when they share no seed."""
    return (read(a_c, *args), read(b_c, *args)) if a_c else (None, None)


def decide(arms, curves: dict, base_arm: str, token_budget: float, design_budgets=(), trained=None
           ) -> dict[str, ArmDecision]:
    """Per arm (`arms`: page.ArmFigures with run_ids and seeds) its ArmDecision against `base_arm`; `curves`:
    run_id -> RunCurve with a `work_seconds` cost; `trained`: run_id -> training tokens."""
    base = next(f for f in arms if f.arm == base_arm)
    out = {}
    for f in arms:
        mine = [curves[i] for i in f.run_ids]
        common = [s for s in f.seeds if s in base.seeds] if f.arm != base_arm else []
        a_c = [curves[f.run_ids[f.seeds.index(s)]] for s in common]
        b_c = [curves[base.run_ids[base.seeds.index(s)]] for s in common]
        a_x, b_x = _both(arm_at, a_c, b_c, "tokens", token_budget)
        test = seed_test(a_x, b_x, common) if a_x is not None and b_x is not None else None
        auc = area_matrix(mine, token_budget)
        a_auc, b_auc = _both(lambda c, b: area_matrix(c, b), a_c, b_c, token_budget)
        dec = ArmDecision(f.arm, len(common), test, bootstrap_mean(auc) if auc is not None else None,
                          paired_difference(a_auc, b_auc) if common and a_auc is not None and b_auc is not None
                          else None)
        for budget in design_budgets:
            x = arm_at(mine, "tokens", budget)
            dec.at_design[budget] = bootstrap_mean(x) if x is not None else None
            a, b = _both(arm_at, a_c, b_c, "tokens", budget)
            dec.diff_design[budget] = paired_difference(a, b) if common and a is not None and b is not None else None
        dec.pairs = {axis: pair_match(a_c, b_c, axis) if common else None for axis in PAIR_AXES}
        dec.exchange = [token_exchange(arm_run.costs["tokens"], arm_run.pass1, base_run.costs["tokens"],
                                       base_run.pass1, token_budget) for arm_run, base_run in zip(a_c, b_c)]
        if trained is not None:
            dec.train_tokens = float(np.mean([trained.get(i, 0) for i in f.run_ids]))
        out[f.arm] = dec
    return out
