"""docs/evidence.md from a comparison's store: the tables, the curves and the SQL behind them.

`build` reads the figures (tasks/compare/figures.py) and computes, per arm, held-out pass@1 at the matched budget
on each axis (tokens, steps, seconds; tasks/core/curves.py) with its two-way bootstrap interval and its
paired difference to the base arm (tasks/core/stats.py), the budget accounting (tokens by purpose,
informative-group ratio, discarded share, tokens per correct held-out answer) and the external sets' results
of each run's last checkpoint, and what the comparison cost (wall time and tokens per run). `markdown` writes
the page; tasks/compare/plots.py draws its curves. Nothing here runs a model: the page is a pure function
of the store and the comparison's plan. It is over 300 lines because the page's sections (figures, verdict,
ablations, tables, cost, SQL) read one `Evidence` and are kept together so each number's origin is in one file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import polars as pl

from storage.store import Store
from tasks.compare.figures import AXES, arm_at, eval_token_share, frame, query, run_curves
from tasks.core.curves import matched_budget
from tasks.core.stats import Interval, bootstrap_mean, paired_difference


@dataclass
class ArmFigures:
    arm: str
    run_ids: list[str]
    seeds: list[int]
    rounds: float
    tokens: float  # mean generated tokens per run (evaluation excluded)
    at: dict[str, Interval]  # axis -> pass@1 at the matched budget
    diff: dict[str, Interval | None]  # axis -> paired difference to the base arm
    last: Interval  # pass@1 of each run's last checkpoint
    purposes: dict[str, float]  # mean tokens per run by purpose
    informative: float
    discarded_share: float
    tokens_per_correct: float
    external: dict[str, dict[str, tuple[Interval, Interval | None]]] = field(default_factory=dict)
    paired_base: dict[str, float] = field(default_factory=dict)  # axis -> the base arm's mean over the paired seeds
    wall_s: list[float] = field(default_factory=list)  # each run's wall-clock seconds, start to completion


@dataclass
class Evidence:
    prefix: str
    base_arm: str
    budgets: dict[str, float]
    base_model: Interval  # pass@1 of version 0 (the same model and prompts in every run)
    arms: list[ArmFigures]
    heldout_prompts: int
    samples: int
    curves: dict = field(default_factory=dict)  # run_id -> RunCurve
    by_arm: dict[str, list[str]] = field(default_factory=dict)
    external_base: dict[str, dict[str, Interval]] = field(default_factory=dict)  # dataset -> kind -> version 0
    eval_token_share: float = 0.0  # evaluation tokens / all generated tokens of the comparison's runs


def _paired(a_curves, b_curves, a_seeds, b_seeds, axis, budget) -> tuple[Interval | None, float]:
    """The paired difference a - b over the seeds both arms ran, and b's mean over those seeds."""
    common = [s for s in a_seeds if s in b_seeds]
    if not common:
        return None, float("nan")
    a = arm_at([a_curves[a_seeds.index(s)] for s in common], axis, budget)
    b = arm_at([b_curves[b_seeds.index(s)] for s in common], axis, budget)
    return (None, float("nan")) if a is None or b is None else (paired_difference(a, b), float(b.mean()))


def build(store: Store, prefix: str, planned: list, datasets: list[str] = (), base_arm: str = "uniform") -> Evidence:
    """The figures of the runs in `planned` (flows.compare.Planned), all finished and evaluated."""
    arms = list(dict.fromkeys(r.arm for r in planned))
    base_arm = base_arm if base_arm in arms else arms[0]
    runs = {a: sorted((r for r in planned if r.arm == a), key=lambda r: r.seed) for a in arms}
    heldout = frame(store, "PASS", prefix)
    curves = run_curves(store, prefix, [r.run_id for r in planned], heldout)
    budgets = {axis: matched_budget(c.last(axis) for c in curves.values()) for axis in AXES}
    marks = [c.last_milestone() for c in curves.values()]
    if all(m is not None for m in marks):  # evaluated at milestones: the largest one every run reached
        budgets["tokens"] = matched_budget(marks)
    groups = frame(store, "GROUPS", prefix)
    discarded = frame(store, "DISCARDED", prefix)
    tokens = frame(store, "TOKENS", prefix)
    share = eval_token_share(tokens.filter(pl.col("run_id").is_in([r.run_id for r in planned])))
    runtime = dict(frame(store, "RUNTIME", prefix).select("run_id", "seconds").iter_rows())
    ext = {name: frame(store, "PASS", prefix, f"dataset:{name}") for name in datasets}
    kinds = {name: _kinds(store, name) for name in datasets}
    base_curves = [curves[r.run_id] for r in runs[base_arm]]
    base_seeds = [r.seed for r in runs[base_arm]]
    out = []
    for a in arms:
        ids, seeds = [r.run_id for r in runs[a]], [r.seed for r in runs[a]]
        mine = [curves[i] for i in ids]
        at = {axis: bootstrap_mean(arm_at(mine, axis, budgets[axis])) for axis in AXES}
        pairs = {axis: (None, float("nan")) if a == base_arm else
                 _paired(mine, base_curves, seeds, base_seeds, axis, budgets[axis]) for axis in AXES}
        diff = {axis: d for axis, (d, _) in pairs.items()}
        last = bootstrap_mean(np.vstack([c.pass1[-1] for c in mine]))
        spent = tokens.filter(pl.col("run_id").is_in(ids))
        purposes = {p: float(spent.filter(pl.col("purpose") == p)["tokens"].sum()) / len(ids)
                    for p in sorted(set(spent["purpose"]))}
        g = groups.filter(pl.col("run_id").is_in(ids))
        d = discarded.filter(pl.col("run_id").is_in(ids))
        final = heldout.join(pl.DataFrame({"run_id": ids, "policy_version": [c.versions[-1] for c in mine]},
                                          schema_overrides={"policy_version": heldout["policy_version"].dtype}),
                             on=["run_id", "policy_version"])
        fig = ArmFigures(
            arm=a, run_ids=ids, seeds=seeds, rounds=float(np.mean([len(c.versions) - 1 for c in mine])),
            tokens=float(np.mean([c.last("tokens") for c in mine])), at=at, diff=diff, last=last,
            purposes=purposes,
            informative=float(g["informative_groups"].sum() / max(1, g["kept_groups"].sum() + g["discarded_groups"].sum())),
            discarded_share=float(d["discarded"].sum() / max(1, d["kept"].sum() + d["discarded"].sum())),
            tokens_per_correct=float(final["n_tokens"].sum() / max(1, final["n_correct"].sum())),
            paired_base={axis: b for axis, (_, b) in pairs.items()},
            wall_s=[float(runtime[i]) for i in ids if i in runtime])
        for name, rows in ext.items():
            fig.external[name] = _external(rows, kinds[name], ids, seeds, runs[base_arm], a == base_arm)
        out.append(fig)
    v0 = np.vstack([c.pass1[0] for c in curves.values()])
    external_base = {}
    for name, rows in ext.items():  # the base model, scored once per comparison: the first run that has it
        base_rows = rows.filter(pl.col("policy_version") == 0)
        if base_rows.height:
            first = base_rows.filter(pl.col("run_id") == base_rows["run_id"].min()).sort("prompt_id")
            external_base[name] = {k: bootstrap_mean(first.filter(pl.col("prompt_id").is_in(keep))["pass1"]
                                                     .to_numpy()[None, :])
                                   for k, keep in _kind_groups(kinds[name]).items()}
    return Evidence(prefix, base_arm, budgets, bootstrap_mean(v0[:1]), out,
                    heldout_prompts=len(next(iter(curves.values())).prompt_ids),
                    samples=int(heldout["n_samples"].max()), curves=curves,
                    by_arm={a: [r.run_id for r in runs[a]] for a in arms}, external_base=external_base,
                    eval_token_share=share)


def _kinds(store: Store, name: str) -> dict[str, str]:
    """prompt_id -> meta.kind of a dataset's prompts ('all' where the file has no kinds)."""
    from storage.query import sql
    from storage.store import check_name

    check_name("dataset name", name)  # so the name needs no quoting below
    t = pl.from_arrow(sql(store, f"SELECT prompt_id, json_extract_string(meta, '$.kind') AS kind FROM prompts "
                                 f"WHERE source = '{name}'"))
    return {p: k or "all" for p, k in zip(t["prompt_id"], t["kind"])}


def _last_matrix(rows: pl.DataFrame, run_ids: list[str], keep) -> np.ndarray | None:
    mats = []
    for r in run_ids:
        mine = rows.filter(pl.col("run_id") == r)
        if mine.height == 0:
            return None
        mine = mine.filter(pl.col("policy_version") == mine["policy_version"].max()).sort("prompt_id")
        mine = mine.filter(pl.col("prompt_id").is_in(keep))
        mats.append(mine["pass1"].to_numpy())
    return np.vstack(mats) if mats and len({m.size for m in mats}) == 1 and mats[0].size else None


def _kind_groups(kinds: dict[str, str]) -> dict[str, list[str]]:
    """'all' and, when the file has more than one kind, each kind: its prompt ids."""
    labels = sorted(set(kinds.values()))
    return {"all": list(kinds)} | ({k: [p for p, v in kinds.items() if v == k] for k in labels} if len(labels) > 1 else {})


def _external(rows, kinds, ids, seeds, base_runs, is_base) -> dict[str, tuple[Interval, Interval | None]]:
    out = {}
    for label, keep in _kind_groups(kinds).items():
        x = _last_matrix(rows, ids, keep)
        if x is None:
            continue
        common = [s for s in seeds if s in [b.seed for b in base_runs]]
        d = None
        if not is_base and common:
            a = _last_matrix(rows, [ids[seeds.index(s)] for s in common], keep)
            b = _last_matrix(rows, [next(r.run_id for r in base_runs if r.seed == s) for s in common], keep)
            d = paired_difference(a, b) if a is not None and b is not None else None
        out[label] = (bootstrap_mean(x), d)
    return out


# ---- the page ------------------------------------------------------------------------------------------------
def _iv(x: Interval | None, signed: bool = False) -> str:
    """mean [low, high]; a difference (signed) also says over how many paired seeds."""
    if x is None:
        return "n/a"
    f = "{:+.3f}" if signed else "{:.3f}"
    text = f"{f.format(x.mean)} [{f.format(x.low)}, {f.format(x.high)}]"
    return text + (f" ({x.seeds} seed{'s' * (x.seeds > 1)})" if signed else "")


def verdict(ev: Evidence, arm: str = "refinery") -> list[str]:
    """The issue's goal, as measured: arm >= base + 10% relative at the matched token budget with the paired
    interval above zero, informative-group ratio >= 0.85, no discarded rollouts."""
    fig = next((f for f in ev.arms if f.arm == arm), None)
    base = next(f for f in ev.arms if f.arm == ev.base_arm)
    if fig is None or fig.arm == base.arm:
        return []
    d, base_mean = fig.diff["tokens"], fig.paired_base["tokens"]
    rel = d.mean / base_mean if d is not None and base_mean > 0 else float("nan")  # over the paired seeds
    checks = [
        (f"`{arm}` >= `{base.arm}` + 10% relative on held-out pass@1 at {ev.budgets['tokens']:.0f} tokens",
         d is not None and rel >= 0.10, f"{rel:+.1%} relative" if d is not None else "no paired seeds"),
        ("the paired interval above zero", d is not None and d.low > 0, _iv(d, True)),
        ("informative-group ratio >= 0.85", fig.informative >= 0.85, f"{fig.informative:.3f}"),
        ("no discarded rollouts", fig.discarded_share == 0, f"{fig.discarded_share:.3f} discarded"),
    ]
    return [f"- {'met' if ok else '**not met**'}: {what} ({got})" for what, ok, got in checks]


def ablation_lines(ev: Evidence, full: str = "refinery") -> list[str]:
    """For each one-part-off arm: its paired difference to the full pipeline at the matched token budget."""
    figs = {f.arm: f for f in ev.arms}
    if full not in figs:
        return []
    out = []
    for f in ev.arms:
        if not f.arm.startswith("no_"):
            continue
        d, _ = _paired([ev.curves[i] for i in f.run_ids], [ev.curves[i] for i in figs[full].run_ids], f.seeds,
                       figs[full].seeds, "tokens", ev.budgets["tokens"])
        if d is None:
            continue
        what = ("pass@1 higher without it" if d.low > 0 else "pass@1 lower without it" if d.high < 0
                else "no difference shown")
        if d.seeds == 1:
            what += " (one seed: the interval resamples prompts only, not training randomness)"
        out.append(f"| `{f.arm}` | {len(set(f.seeds) & set(figs[full].seeds))} | {_iv(d, True)} | {what} |")
    return out


def tables(ev: Evidence, datasets: list[str]) -> str:
    base = ev.base_arm
    lines = [f"### Held-out pass@1 at matched budgets ({ev.heldout_prompts} prompts x {ev.samples} samples)", "",
             f"The matched budgets are the largest every run reached: {ev.budgets['tokens']:.0f} generated tokens, "
             f"{ev.budgets['steps']:.0f} optimizer steps, {ev.budgets['seconds']:.0f} wall-clock seconds. The base "
             f"model (version 0, the same in every run) scores {_iv(ev.base_model)} (prompts resampled only). A "
             "difference is paired over the seeds both arms ran (the count is in brackets); with one seed its "
             "interval resamples prompts only and says nothing of training randomness, and with three the "
             "percentile bootstrap understates it. The last-checkpoint column is not at equal compute: a run "
             "stops once past the budget, so its last checkpoint overshoots by up to a round (tokens/run).", "",
             f"| arm | seeds | rounds | tokens/run | pass@1 @ tokens | vs `{base}` | pass@1 @ steps | vs `{base}` "
             f"| pass@1 @ seconds | vs `{base}` | last checkpoint |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for f in ev.arms:
        lines.append(f"| `{f.arm}` | {len(f.seeds)} | {f.rounds:.1f} | {f.tokens:.0f} | {_iv(f.at['tokens'])} | "
                     f"{_iv(f.diff['tokens'], True)} | {_iv(f.at['steps'])} | {_iv(f.diff['steps'], True)} | "
                     f"{_iv(f.at['seconds'])} | {_iv(f.diff['seconds'], True)} | {_iv(f.last)} |")
    purposes = sorted({p for f in ev.arms for p in f.purposes})
    lines += ["", "### Budget accounting (tokens: means per run; ratios: pooled over the arm's runs)", "",
              "| arm | " + " | ".join(f"{p} tokens" for p in purposes) + " | informative groups | discarded "
              "rollouts | evaluation tokens per correct held-out answer (last checkpoint) |",
              "|---|" + "---|" * (len(purposes) + 3)]
    for f in ev.arms:
        lines.append(f"| `{f.arm}` | " + " | ".join(f"{f.purposes.get(p, 0.0):.0f}" for p in purposes)
                     + f" | {f.informative:.3f} | {f.discarded_share:.3f} | {f.tokens_per_correct:.1f} |")
    for name in datasets:
        labels = list(dict.fromkeys(k for f in ev.arms for k in f.external.get(name, {})))
        if not labels:
            continue
        lines += ["", f"### External set `{name}`: pass@1 of each run's last checkpoint", "",
                  "Not at equal compute (see the last-checkpoint column above).", "",
                  "| arm | " + " | ".join(f"{k} | {k} vs `{base}`" for k in labels) + " |",
                  "|---|" + "---|---|" * len(labels)]
        if name in ev.external_base:
            lines.append("| base model | " + " | ".join(f"{_iv(ev.external_base[name].get(k))} | " for k in labels) + " |")
        for f in ev.arms:
            cells = [f.external.get(name, {}).get(k) for k in labels]
            lines.append(f"| `{f.arm}` | " + " | ".join("n/a | n/a" if c is None else f"{_iv(c[0])} | {_iv(c[1], True)}"
                                                       for c in cells) + " |")
    return "\n".join(lines)


def cost_lines(ev: Evidence) -> list[str]:
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


def sql_section(prefix: str, datasets: list[str]) -> str:
    parts = ["## The SQL behind each number", "",
             "Each query runs as is with `refinery sql --store STORE \"...\"`; the page's numbers are computed "
             "from their results, restricted to the runs it lists (interpolation and the bootstrap are "
             "tasks/core/curves.py and tasks/core/stats.py)."]
    for name, what in [("CHECKPOINTS", "each checkpoint's cost: tokens, steps and seconds before it"),
                       ("PASS", "per-prompt held-out pass@1 of every checkpoint"),
                       ("GROUPS", "informative-group ratio per run"),
                       ("DISCARDED", "discarded rollouts per run"),
                       ("TOKENS", "generated tokens per run and purpose"),
                       ("RUNTIME", "wall-clock seconds per run")]:
        parts += ["", f"{what} (`{name}`):", "", "```sql", query(name, prefix), "```"]
    for name in datasets:
        parts += ["", f"external set `{name}` (`PASS` on its split):", "", "```sql",
                  query("PASS", prefix, f"dataset:{name}"), "```"]
    return "\n".join(parts)


def markdown(ev: Evidence, datasets: list[str], header: str, design: str, notes: str = "") -> str:
    """The whole page: `header` and `design` come from the caller (machine, commit, config), the rest from ev;
    `notes` (a hand-written reading of the figures, with its own heading) follows the verdict."""
    parts = [header, "", "## Result against the goal", "", *(verdict(ev) or ["(no `refinery` arm in this comparison)"]),
             ""]
    if notes:
        parts += [notes.strip(), ""]
    parts += ["## Tables", "", tables(ev, datasets), ""]
    abl = ablation_lines(ev)
    if abl:
        parts += ["### Ablations: each one-part-off arm minus `refinery` at the matched token budget (paired seeds)", "",
                  "| arm | paired seeds | difference | reading |", "|---|---|---|---|", *abl, ""]
    parts += ["## Cost of this comparison", "", *cost_lines(ev), ""]
    parts += ["## Curves", ""] + [f"![held-out pass@1 against {label}](evidence/pass1_vs_{axis}.png)" for axis, label in AXES.items()]
    parts += ["", design, ""]
    parts += [sql_section(ev.prefix, datasets), ""]
    return "\n".join(parts)
