"""The comparison's headline figures as JSON (`benchmarks/evidence.py --json PATH`), the same numbers the page
prints (tasks/compare/page.py, sections.py), for scripts and the issues' "done when" checks.

Top-level keys: `heldout_prompts`, `eval_samples`, `eval_token_share`, `commits`, `dirty_runs`, `matched_<axis>`
(the budgets every run reached), `design_budgets`, `heldout_strata` (per stratum: `prompts`, `never_solved`,
`pass1` per arm at the matched token budget), `external_checkpoint` (per external set: `matched` or `last`);
the flat per-arm keys written before issue 49 (`<arm>_pass1_at_tokens`, `<arm>_vs_uniform_at_tokens`,
`<arm>_informative`, `<arm>_discarded_share`); and `arms`: per arm `pass1_at_budget`, `vs_uniform`
([difference, low, high], null for the base arm), `relative_vs_uniform`, `paired_seeds`, `seed_test_p`,
`seed_differences`, `t_interval`, `power_seeds_needed`, `informative_ratio`, `discarded_share`,
`pass1_at` (per design budget, null where not reached), `auc`, `auc_vs_uniform`, `token_exchange` (the median
over paired seeds of uniform's generated tokens over the arm's for the same pass@1, the lower of the pair's at
the budget; tasks/core/curves.py) and
`token_exchange_per_seed`, `matched_steps` and
`matched_work_seconds` (the pair's budget and [difference, low, high]), `train_tokens`, `generated_tokens`,
`pass1_without_never_solved`. A figure that does not exist (one seed's interval) is null, never NaN.
"""

from __future__ import annotations

import math

from tasks.core.stats import Interval
from tasks.reporting.budget import counts


def _num(x) -> float | int | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _triple(x: Interval | None) -> list[float | None] | None:
    return None if x is None else [_num(x.mean), _num(x.low), _num(x.high)]


def headline(ev, commits: list[str], dirty_runs: list[str]) -> dict:
    out = {"heldout_prompts": ev.heldout_prompts, "eval_samples": ev.samples, "commits": commits,
           "dirty_runs": dirty_runs, "eval_token_share": ev.eval_token_share,
           **{f"matched_{k}": v for k, v in ev.budgets.items()}, "design_budgets": list(ev.design_budgets),
           "heldout_strata": {s.name: {"prompts": s.prompts, "never_solved": s.never_solved, "pass1": s.pass1}
                              for s in ev.strata},
           "external_checkpoint": dict(ev.external_at), "arms": {}}
    for f in ev.arms:
        out[f"{f.arm}_pass1_at_tokens"] = f.at["tokens"].mean
        if f.diff["tokens"] is not None:
            out[f"{f.arm}_vs_{ev.base_arm}_at_tokens"] = f.diff["tokens"].mean
        out[f"{f.arm}_informative"] = f.informative
        out[f"{f.arm}_discarded_share"] = f.discarded_share
        d = ev.decisions[f.arm]
        t = d.test
        without = ev.without_never_solved.get(f.arm)
        out["arms"][f.arm] = {
            "pass1_at_budget": f.at["tokens"].mean, "vs_uniform": _triple(f.diff["tokens"]),
            "relative_vs_uniform": _num(t.relative) if t else None, "paired_seeds": d.paired_seeds,
            "seed_test_p": t.p if t else None, "seed_differences": t.d if t else None,
            "t_interval": [_num(x) for x in t.t] if t else None,
            "power_seeds_needed": t.power_seeds if t else None,
            "informative_ratio": f.informative, "discarded_share": f.discarded_share,
            "pass1_at": {str(b): (_num(x.mean) if x else None) for b, x in d.at_design.items()},
            "auc": _num(d.auc.mean) if d.auc else None, "auc_vs_uniform": _triple(d.auc_diff),
            "token_exchange": _num(d.exchange_median),
            "token_exchange_per_seed": [_num(x) for x in d.exchange] if d.paired_seeds else None,
            **{f"matched_{axis}": ({"budget": m.budget, "difference": _triple(m.diff)} if m else None)
               for axis, m in d.pairs.items()},
            "train_tokens": _num(d.train_tokens),
            "generated_tokens": sum(v for p, v in f.purposes.items() if counts(p)),
            "pass1_without_never_solved": _num(without[0].mean) if without else None,
        }
    return out
