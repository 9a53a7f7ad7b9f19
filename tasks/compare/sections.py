"""The page's sections for issue 49's figures (tasks/compare/decide.py, strata.py, timing.py): the seed-level
test beside the bootstrap with its power line, held-out pass@1 per stratum with never-solved strata flagged,
pass@1 at the design's budgets and the area under the curve, matched steps and seconds per pair of arms, and
training tokens beside generated ones, what each token-spending component made against plain rollouts (the
budget governor's figures); and the page's cost and SQL sections. Each reads one `Evidence`
(tasks/compare/page.py) and returns lines.
"""

from __future__ import annotations

import math

import numpy as np
import polars as pl

from tasks.compare.decide import PAIR_AXES, RELATIVE_EFFECT
from tasks.compare.figures import query
from tasks.compare.strata import query as strata_query
from tasks.core.seed_test import MIN_SEEDS_FOR_5PCT
from tasks.core.stats import Interval
from tasks.reporting.budget import counts


def _iv(x: Interval | None, signed: bool = False) -> str:
    if x is None:
        return "n/a"
    f = "{:+.3f}" if signed else "{:.3f}"
    return f"{f.format(x.mean)} [{f.format(x.low)}, {f.format(x.high)}]"


def _t(t) -> str:
    mean, lo, hi = t
    return f"{mean:+.3f} [{lo:+.3f}, {hi:+.3f}]" if math.isfinite(lo) else f"{mean:+.3f} (one seed: no interval)"


def seed_lines(ev) -> list[str]:
    base = ev.base_arm
    lines = [f"### The seed-level test beside the bootstrap (each arm minus `{base}` at "
             f"{ev.budgets['tokens']:.0f} tokens)", "",
             "The decision is the seed-level paired test (tasks/core/seed_test.py): d_s is the arm's mean held-out "
             f"pass@1 minus `{base}`'s at seed s; the exact sign-flip p is over all 2^S sign patterns (its smallest "
             f"value is 2/2^S: 0.25 with 3 seeds, 0.125 with 4, below 5% only from {MIN_SEEDS_FOR_5PCT}); the "
             "t-interval is over seeds; the power line is the paired seeds a test at 5% needs for 80% power "
             f"against +{RELATIVE_EFFECT:.0%} of `{base}`'s pass@1 when seeds spread as observed. The bootstrap "
             "(two-way, seeds and prompts) describes; with few seeds it understates the seed part.", "",
             "| arm | paired seeds | d per seed | bootstrap | t-interval over seeds | sign-flip p | relative | "
             f"seeds for +{RELATIVE_EFFECT:.0%} relative |", "|---|---|---|---|---|---|---|---|"]
    for f in ev.arms:
        t = ev.decisions[f.arm].test
        if t is None:
            continue
        need = "n/a (one seed: no spread)" if t.power_seeds is None else (
            f"{t.power_seeds}" if t.power_seeds <= 1000 else "more than 1000")
        lines.append(f"| `{f.arm}` | {len(t.seeds)} | {', '.join(f'{x:+.3f}' for x in t.d)} | "
                     f"{_iv(f.diff['tokens'], True)} | {_t(t.t)} | {t.p:.3f} | {t.relative:+.1%} | {need} |")
    return lines


def strata_lines(ev) -> list[str]:
    arms = [f.arm for f in ev.arms]
    never = [s for s in ev.strata if s.never_solved]
    lines = [f"### Held-out pass@1 per stratum at {ev.budgets['tokens']:.0f} tokens ({ev.heldout_prompts} prompts)",
             "", "A stratum is one pool source entry (tasks/compare/strata.py). **Never solved** marks a stratum no "
             "evaluated checkpoint of any run (base model included) solved once: it only dilutes every difference.",
             "", "| stratum | prompts | " + " | ".join(f"`{a}`" for a in arms) + " |", "|---|---|" + "---|" * len(arms)]
    for s in ev.strata:
        flag = " **(never solved)**" if s.never_solved else ""
        lines.append(f"| `{s.name}`{flag} | {s.prompts} | "
                     + " | ".join(f"{s.pass1[a]:.3f}" if a in s.pass1 else "n/a" for a in arms) + " |")
    if not never:
        lines += ["", "No stratum is never solved: the totals above stand as they are."]
        return lines
    kept = ev.heldout_prompts - sum(s.prompts for s in never)
    lines += ["", f"Totals with and without the never-solved strata ({', '.join(f'`{s.name}`' for s in never)}; "
              f"{kept} of {ev.heldout_prompts} prompts left):", "",
              f"| arm | pass@1, all | vs `{ev.base_arm}`, all | pass@1, without | vs `{ev.base_arm}`, without |",
              "|---|---|---|---|---|"]
    for f in ev.arms:
        w = ev.without_never_solved.get(f.arm)
        lines.append(f"| `{f.arm}` | {_iv(f.at['tokens'])} | {_iv(f.diff['tokens'], True)} | "
                     f"{_iv(w[0]) if w else 'n/a'} | {_iv(w[1], True) if w else 'n/a'} |")
    return lines


def budget_lines(ev) -> list[str]:
    base = ev.base_arm
    reach = min(c.last("tokens") for c in ev.curves.values())
    head = "".join(f" pass@1 @ {b} | vs `{base}` |" for b in ev.design_budgets)
    lines = ["### The design's budgets and the area under the curve", "",
             f"Pass@1 at each budget of the design, where every run of the arm reached it (the runs here reach "
             f"{reach:.0f} generated tokens at least; a budget past a run's last checkpoint is not reached, never "
             f"extrapolated), and the area under the pass@1-generated-token curve from 0 to the matched budget "
             f"({ev.budgets['tokens']:.0f}; trapezoid over the measured checkpoints, divided by the budget: the "
             "mean pass@1 over the budget; tasks/core/curves.py).", "",
             f"| arm |{head} area under the curve | vs `{base}` |",
             "|---|" + "---|---|" * len(ev.design_budgets) + "---|---|"]
    for f in ev.arms:
        d = ev.decisions[f.arm]
        cells = "".join(f" {_iv(d.at_design[b]) if d.at_design[b] else 'not reached'} | "
                        f"{_iv(d.diff_design[b], True) if d.diff_design[b] else ('not reached' if d.at_design[b] is None else 'n/a')} |"
                        for b in ev.design_budgets)
        lines.append(f"| `{f.arm}` |{cells} {_iv(d.auc)} | {_iv(d.auc_diff, True)} |")
    return lines


def exchange_lines(ev) -> list[str]:
    base = ev.base_arm
    rows = [(f.arm, ev.decisions[f.arm]) for f in ev.arms if ev.decisions[f.arm].paired_seeds]
    if not rows:
        return []
    lines = [f"### Token exchange against `{base}` at {ev.budgets['tokens']:.0f} tokens (paired seeds)", "",
             f"Per paired seed, `{base}`'s generated tokens over the arm's for the same mean held-out pass@1: the "
             "lower of the pair's figures at the budget, and the tokens each run first reached it with, on its "
             "curve through its checkpoints (linear between them; tasks/core/curves.py `token_exchange`). Above "
             "1.00x the arm learns with fewer tokens (2.00x: half). It is read within the budget, not as what "
             f"`{base}` would need to match a higher figure, and it is as coarse as the milestones between which it "
             "is read; n/a where neither run rose above the base model.", "",
             "| arm | paired seeds | per seed | median |", "|---|---|---|---|"]
    for arm, d in rows:
        per = ", ".join("n/a" if x is None else f"{x:.2f}x" for x in d.exchange)
        med = d.exchange_median
        lines.append(f"| `{arm}` | {d.paired_seeds} | {per} | {'n/a' if med is None else f'{med:.2f}x'} |")
    return lines


def pair_lines(ev) -> list[str]:
    base = ev.base_arm
    lines = [f"### Matched steps and seconds per pair (each arm and `{base}` over their paired seeds)", "",
             "Each pair is matched at the smaller of the two arms' reach on the axis (the smallest last cost over "
             "the pair's runs), not at the slowest run of the whole comparison. Seconds are generation and "
             "training only, from the stages' commit records (tasks/compare/timing.py): evaluation, reports and "
             "the time a run stood stopped are not in them.", "",
             "| arm | paired seeds | " + " | ".join(f"{label}: budget | arm | `{base}` | difference"
                                                     for label in PAIR_AXES.values()) + " |",
             "|---|---|" + "---|---|---|---|" * len(PAIR_AXES)]
    for f in ev.arms:
        d = ev.decisions[f.arm]
        if not d.paired_seeds:
            continue
        cells = [f"{m.budget:.0f} | {_iv(m.arm)} | {_iv(m.base)} | {_iv(m.diff, True)}" if m else "n/a | n/a | n/a | n/a"
                 for m in (d.pairs[a] for a in PAIR_AXES)]
        lines.append(f"| `{f.arm}` | {d.paired_seeds} | " + " | ".join(cells) + " |")
    return lines


def token_lines(ev) -> list[str]:
    lines = ["### Generated, training and prefill tokens per run", "",
             "Generated tokens exclude evaluation; training tokens are the tokens the optimizer stepped on "
             "(`TRAINED`). Prefill tokens (prompts, few-shot turns, LoPE prefixes, MCMC contexts) are not recorded "
             "in the store (models/meter.py counts completions only), so they are not reported.", "",
             "| arm | generated tokens | training tokens | prefill tokens |", "|---|---|---|---|"]
    for f in ev.arms:
        gen = sum(v for p, v in f.purposes.items() if counts(p))
        lines.append(f"| `{f.arm}` | {gen:.0f} | {ev.decisions[f.arm].train_tokens:.0f} | not recorded |")
    return lines


UNITS = {"lope": "rows of rescued groups", "shape": "verified shaped traces", "refine": "accepted refinements",
         "topup": "rows of top-ups that came out mixed"}  # what the governor counts as a component's rows


def yield_lines(ev) -> list[str]:
    """Per arm and component that spent tokens on top of plain rollouts: its tokens per run and its yield beside
    plain rollouts' in the same rounds (means of the governor's per-round figures), the rounds it fell below and
    the rounds it ran throttled; then the components whose mean yield fell below the baseline's, and the arms
    with no governor rows at all (`governor.enabled` false, or runs made before the governor), which the table
    cannot show. None where no component of any run generated anything (or no run has governor rows)."""
    rows = ev.yields
    if rows is None or rows.height == 0 or not (rows["rounds_active"] > 0).any():
        return []
    lines = ["### What each token-spending component made (the budget governor's measurements)", "",
             "Training rows per 1k generated tokens of each component on top of plain rollouts, beside plain "
             "rollouts' rows per 1k collect tokens (rows of informative groups) in the same rounds, as the "
             "governor measured them before deciding each next round (tasks/core/governor.py; its last round is "
             "not measured): means over the rounds the component generated in. A component's rows are: "
             + "; ".join(f"{c}, {u}" for c, u in UNITS.items()) + ". Tokens are per run over the measured rounds.",
             "", "| arm | component | tokens per run | its rows per 1k | plain rollouts' rows per 1k "
             "| rounds below / generating | rounds throttled |", "|---|---|---|---|---|---|---|"]
    arm_of = pl.DataFrame({"run_id": [i for f in ev.arms for i in f.run_ids],
                           "arm": [f.arm for f in ev.arms for _ in f.run_ids],
                           "runs": [len(f.run_ids) for f in ev.arms for _ in f.run_ids],
                           "order": [k for k, f in enumerate(ev.arms) for _ in f.run_ids]})
    per_arm = (rows.join(arm_of, on="run_id")
               .group_by("order", "arm", "component")
               .agg(pl.col("runs").first(), *(pl.col(c).sum() for c in ("rounds_active", "tokens", "yield_sum",
                                                                           "baseline_sum", "rounds_below",
                                                                           "rounds_throttled")))
               .filter(pl.col("rounds_active") > 0).sort("order", "component"))
    short = []
    for c in per_arm.iter_rows(named=True):
        own, base = c["yield_sum"] / c["rounds_active"], c["baseline_sum"] / c["rounds_active"]
        lines.append(f"| `{c['arm']}` | {c['component']} | {c['tokens'] / c['runs']:.0f} | {own:.1f} | {base:.1f} | "
                     f"{c['rounds_below']} / {c['rounds_active']} | {c['rounds_throttled']} |")
        if own < base:
            short.append(f"`{c['arm']}`'s {c['component']} ({own:.1f} against {base:.1f})")
    lines += ["", "Below plain rollouts' yield on average: " + (", ".join(short) if short else "none") + "."]
    unmeasured = [f"`{f.arm}`" for f in ev.arms if not rows["run_id"].is_in(f.run_ids).any()]
    if unmeasured:
        lines.append(f"No governor rows (governor off, or runs made before it): {', '.join(unmeasured)}.")
    return lines


def sections(ev) -> list[str]:
    out = []
    for part in (seed_lines, strata_lines, budget_lines, exchange_lines, pair_lines, token_lines, yield_lines):
        lines = part(ev)
        out += [*lines, ""] if lines else []  # a section with nothing to show leaves no blank line either
    return out


def cost_lines(ev) -> list[str]:
    """What the comparison cost: each arm's wall time per run and generated tokens per run (training budget and
    evaluation), and the totals."""
    lines = ["| arm | runs | wall time per run in minutes: mean (min-max) | generated tokens per run | of them evaluation |",
             "|---|---|---|---|---|"]
    total_s = total_tokens = total_eval = 0.0
    for f in ev.arms:
        per_run = sum(f.purposes.values())
        total_tokens += per_run * len(f.run_ids)
        total_eval += f.purposes.get("eval", 0.0) * len(f.run_ids)
        total_s += sum(f.wall_s)
        wall = (f"{np.mean(f.wall_s) / 60:.1f} ({min(f.wall_s) / 60:.1f}-{max(f.wall_s) / 60:.1f})" if f.wall_s
                else "n/a")
        lines.append(f"| `{f.arm}` | {len(f.run_ids)} | {wall} | {per_run:.0f} | {f.purposes.get('eval', 0.0):.0f} |")
    lines += ["", f"In all: {sum(len(f.run_ids) for f in ev.arms)} runs, {total_s / 3600:.1f} hours of wall-clock time one after another, "
              f"{total_tokens / 1e6:.2f}M generated tokens, {total_eval / max(total_tokens, 1):.0%} of them "
              f"evaluation (eval_token_share {ev.eval_token_share:.3f}). A run's wall time counts each of its starts until it failed or completed (`RUNTIME`)."]
    return lines


def sql_section(prefix: str, datasets: list[str], first_run: str | None = None) -> str:
    parts = ["## The SQL behind each number", "",
             "Each query runs as is with `refinery sql --store STORE \"...\"`; the page's numbers are computed "
             "from their results, restricted to the runs it lists (interpolation and the bootstrap are "
             "tasks/core/curves.py and tasks/core/stats.py)."]
    for name, what in [("CHECKPOINTS", "each checkpoint's cost: tokens, steps and seconds before it"),
                       ("PASS", "per-prompt held-out pass@1 of every checkpoint"),
                       ("GROUPS", "informative-group ratio per run"),
                       ("DISCARDED", "discarded rollouts per run"),
                       ("TOKENS", "generated tokens per run and purpose"),
                       ("RUNTIME", "wall-clock seconds per run"),
                       ("TRAINED", "optimizer steps and training tokens per run"),
                       ("YIELDS", "each token-spending component's yield beside plain rollouts', per run")]:
        parts += ["", f"{what} (`{name}`):", "", "```sql", query(name, prefix), "```"]
    if first_run:
        parts += ["", "each held-out prompt's stratum (`STRATA`, tasks/compare/strata.py; where `stratum` is null, "
                  "the name is made from `source` and `params`):", "", "```sql", strata_query(first_run), "```"]
    for name in datasets:
        parts += ["", f"external set `{name}` (`PASS` on its split):", "", "```sql",
                  query("PASS", prefix, f"dataset:{name}"), "```"]
    return "\n".join(parts)
