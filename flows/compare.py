"""Arms side by side: the same pool, held-out split and paired seeds, one curriculum run per (arm, seed), in
one store (issue 15's comparison; docs/algorithms.md, budget).

An arm is a named list of config overrides on top of the shared ones (tasks/compare/arms.py `ARMS`: the built-in
arms and what each means; `--arm` defines more).
Seed s sets every arm's `rollout.seed`, `select.seed`, `shape.seed` and `train.seed` alike, so arms pair by
seed; the pool's and the evaluation's seeds stay shared: every run draws the same pool and holds out the same
prompts. Run ids are `<prefix>-<arm>-s<seed>`, ordinary runs of the store: rerunning the comparison resumes the
unfinished ones. `max_generated_tokens` puts every run on one token budget. Runs go one after the other. When
done, `summary_lines` reports each arm's held-out pass@1 of its final checkpoints (95% two-way bootstrap over
seeds and prompts), its tokens and its paired difference to `uniform` (or the first arm).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from tasks.compare.arms import ARMS, SEEDED


@dataclass(frozen=True)
class Planned:
    arm: str
    seed: int
    run_id: str
    sets: list[str]


def plan(arms: list[str], seeds: int, prefix: str, shared: list[str], extra: dict[str, list[str]]) -> list[Planned]:
    """The runs of a comparison, seed-major (every arm's seed 0 first, so a partial comparison is paired)."""
    known = {**ARMS, **extra}
    unknown = [a for a in arms if a not in known]
    if unknown:
        raise ValueError(f"unknown arm {unknown[0]!r}: use one of {', '.join(known)} or define it with --arm")
    if not arms or len(set(arms)) != len(arms):
        raise ValueError("--arms needs at least one arm, each named once")
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    return [Planned(a, s, f"{prefix}-{a}-s{s}", [*shared, *known[a], *(f"{k}={s}" for k in SEEDED)])
            for s in range(seeds) for a in arms]


@dataclass(frozen=True)
class Comparison:
    """A comparison's planned runs, each with its checked config, the prompt files to score them on, and the
    warning that its runs come from more than one commit or from code with uncommitted changes (None: one
    clean commit; with `allow_mixed` only, else prepare_comparison refuses)."""

    runs: list[Planned]
    configs: list
    datasets: list[str]
    mixed: str | None = None


def code_of_runs(store, run_ids: list[str]) -> tuple[list[str], list[str]]:
    """(the distinct commits, the runs made with uncommitted changes) over the rows where the runs started or
    resumed work (storage/provenance.py); a row written before commits were recorded counts as `unrecorded`."""
    import polars as pl

    from storage.query import table_rows_with_schema

    # the table's schema: files from before `commit` read it as null (scan takes the first file's columns)
    rows = (table_rows_with_schema(store, "runs", ["run_id", "status", "commit", "dirty"])
            .filter(pl.col("run_id").is_in(run_ids) & pl.col("status").is_in(["running", "resumed"])))
    commits = sorted({c or "unrecorded" for c in rows["commit"].to_list()})
    return commits, sorted(set(rows.filter(pl.col("dirty").fill_null(False))["run_id"].to_list()))


def mixed_code(store, run_ids: list[str], runs_now: bool, allow_mixed: bool) -> str | None:
    """None when the comparison's runs, and this code where `runs_now` (a planned run is unfinished), come from
    one commit with no uncommitted changes; else one line saying what is mixed, which `allow_mixed` turns
    from a refusal (ValueError) into the comparison's warning."""
    from storage.provenance import code_version

    commits, dirty = code_of_runs(store, run_ids)
    now, now_dirty = code_version()
    if runs_now:
        commits = sorted({*commits, now})
    problems = []
    if "unrecorded" in commits:
        problems.append("some runs were made before runs recorded their commit, so their code is unknown")
    if len(commits) > 1:
        problems.append(f"its runs come from {len(commits)} commits ({', '.join(c[:12] for c in commits)})")
    if dirty:
        problems.append(f"{len(dirty)} run(s) were made with uncommitted changes ({', '.join(dirty[:3])}"
                        f"{' ...' if len(dirty) > 3 else ''})")
    if runs_now and now_dirty:
        problems.append(f"this code ({now[:12]}) has uncommitted changes")
    if not problems:
        return None
    line = "mixed code: " + "; ".join(problems)
    if not allow_mixed:
        raise ValueError(f"{line}: a comparison describes one commit; commit (or stash) the changes, finish it at "
                         "one commit or use another --prefix, or pass --allow-mixed")
    return line


def prepare_comparison(arms: list[str], seeds: int, prefix: str, shared: list[str], extra: dict[str, list[str]],
                       rounds: int | None, store: str | None, config_path: str | None = None,
                       datasets: list[str] = (), allow_mixed: bool = False) -> Comparison:
    """Plan the runs and check every config and every prompt file in `datasets` (an external set,
    flows/evaluate.py) before the first run starts: a bad one is refused now, not after hours of runs, and so
    is a comparison whose runs would come from more than one commit or from uncommitted code (`mixed_code`)
    unless `allow_mixed`. Nothing runs or lands here (`refinery compare` calls it while Prefect's server
    starts)."""
    from flows.config import load_config, resumed_config
    from flows.preflight import validate_for_run
    from storage.store import Store, default_root

    runs = plan(arms, seeds, prefix, shared, extra)
    # a run that exists resumes from its stored config: a default changed since it started is no change
    configs = [load_config(config_path, sets=r.sets, stored=resumed_config(store or default_root(), r.run_id),
                           run_id=r.run_id, rounds=rounds, store=store) for r in runs]
    for c in configs:
        validate_for_run(c)
    ids = [r.run_id for r in runs]
    unfinished = any(already_complete(c) is None for c in configs)
    mixed = mixed_code(Store(configs[0].store), ids, unfinished, allow_mixed)
    if datasets:
        from flows.evaluate import dataset_prompts, refuse_other_file

        names = {}
        for path in datasets:
            name, _, frame, _ = dataset_prompts(path, None)
            if name in names:
                raise ValueError(f"--dataset {path} and {names[name]} share the name {name!r}: rename one file")
            names[name] = path
            refuse_other_file(Store(configs[0].store), [r.run_id for r in runs], name, set(frame["prompt_id"]),
                              "rename the file or use another --prefix")
    return Comparison(runs, configs, list(datasets), mixed)


def budget_checkpoint(store, run_id: str, budget: int | None) -> int | None:
    """The checkpoint evaluated at the run's largest generated-token milestone within `budget` (any, when
    None): the one its held-out curve is read at when the comparison is matched there. None for a run
    evaluated every round (no milestones)."""
    import polars as pl

    from storage.query import table_rows_with_schema

    # with the table's schema: evals written before `milestone` existed read it as null
    marks = (table_rows_with_schema(store, "evals", ["split", "milestone", "policy_version"], run_id=run_id)
             .filter((pl.col("split") == "heldout") & (pl.col("milestone") > 0)))
    if budget is not None:
        marks = marks.filter(pl.col("milestone") <= budget)
    return None if marks.height == 0 else int(marks.sort("milestone", "policy_version")["policy_version"][-1])


def run_comparison(comparison: Comparison, on_run=None, only: Collection[str] | None = None) -> list[dict]:
    """Run (or resume) every planned run; returns one summary per run (its plan and its flow result). Each
    prompt file scores every run's checkpoint at its largest milestone within the token budget
    (`budget_checkpoint`: the checkpoint at the matched budget when every run reached it, issue 49 item 6) and
    its last checkpoint once it finishes, and the first run's base model (version 0, the same in every run).
    `only`: just these runs, each as the whole comparison runs it (benchmarks/evidence.py `--only`)."""
    from flows.curriculum import curriculum
    from flows.evaluate import evaluate
    from storage.store import Store

    if only is not None and (unknown := sorted(set(only) - {r.run_id for r in comparison.runs})):
        raise ValueError(f"not a planned run: {', '.join(unknown)}")
    out = []
    for i, (r, c) in enumerate(zip(comparison.runs, comparison.configs)):
        if only is not None and r.run_id not in only:
            continue
        if on_run:
            on_run(r)
        result = already_complete(c) or curriculum(c)
        at_budget = budget_checkpoint(Store(c.store), r.run_id, c.max_generated_tokens) if comparison.datasets else None
        for path in comparison.datasets:
            for version in dict.fromkeys(([0] if i == 0 else []) + ([at_budget] if at_budget is not None else [])
                                         + [None]):
                evaluate(run_id=r.run_id, checkpoint=version, store=c.store, dataset=path)
        out.append({"planned": r, "result": result})
    return out


def compare(arms: list[str], seeds: int, prefix: str, shared: list[str], extra: dict[str, list[str]],
            rounds: int | None, store: str | None, config_path: str | None = None, on_run=None,
            datasets: list[str] = (), allow_mixed: bool = False) -> list[dict]:
    """`prepare_comparison`, then `run_comparison`."""
    return run_comparison(prepare_comparison(arms, seeds, prefix, shared, extra, rounds, store, config_path,
                                             datasets, allow_mixed), on_run)


def already_complete(config) -> dict | None:
    """A short result for a run that already completed with this very config, else None. Such a run is not
    started again: it would only confirm that every stage landed, and that walk needs its checkpoints on
    disk, which a comparison store copied without its `_checkpoints/` (or on another host) no longer has."""
    import json

    from flows.resume import check_resume
    from storage.runs import run_rows
    from storage.store import Store

    rows = run_rows(Store(config.store), config.run_id)
    if rows.height == 0 or rows["status"][-1] != "completed":
        return None
    before = json.loads(rows["config"][-1])
    check_resume(config, before)  # refuses a changed field that decides landed data, as a resume would
    if (before.get("rounds"), before.get("max_generated_tokens")) != (config.rounds, config.max_generated_tokens):
        return None  # a longer (or shorter) run asked for: run it
    reason = rows["reason"][-1]
    return {"run_id": config.run_id, "seconds": 0.0, "skipped": "already complete",
            **({"stopped": reason} if reason and reason.startswith("token budget") else {})}


def final_matrix(store, run_ids: list[str]) -> tuple[np.ndarray, list[int]]:
    """x[run, prompt]: held-out pass@1 of each run's newest evaluated checkpoint (eval_results), prompts in
    prompt-id order, and the runs' generated tokens (evaluation excluded)."""
    import polars as pl

    from storage.query import scan
    from tasks.reporting.budget import spent_by_run

    res = scan(store, "eval_results").filter(pl.col("run_id").is_in(run_ids) & (pl.col("split") == "heldout"))
    newest = res.group_by("run_id").agg(pl.col("policy_version").max().alias("v"))
    rows = (res.join(newest, on="run_id").filter(pl.col("policy_version") == pl.col("v"))
            .with_columns((pl.col("n_correct") / pl.col("n_samples")).alias("p1")).collect())
    wide = rows.pivot(on="prompt_id", index="run_id", values="p1", aggregate_function="first")
    missing = [r for r in run_ids if r not in wide["run_id"].to_list()]
    if missing:
        raise ValueError(f"run {missing[0]} has no held-out evaluation in eval_results (eval.enabled off, or a "
                         "store written before eval_results)")
    wide = wide.join(pl.DataFrame({"run_id": run_ids, "order": range(len(run_ids))}), on="run_id").sort("order")
    cols = sorted(c for c in wide.columns if c not in ("run_id", "order"))
    tokens = spent_by_run(store, run_ids)
    return wide.select(cols).to_numpy(), [tokens[r] for r in run_ids]


def matched_lines(store, prefix: str, runs: list[Planned]) -> list[str]:
    """Per arm: held-out pass@1 at the comparison's matched token budget (the largest every run reached,
    interpolated per prompt between checkpoints; tasks/core/curves.py), its paired difference to `uniform`
    (or the first arm) and the token exchange against it (the median over paired seeds)."""
    from tasks.compare.page import build

    ev = build(store, prefix, runs)
    lines = [f"at the matched budget of {ev.budgets['tokens']:.0f} generated tokens:"]
    for f in ev.arms:
        at, diff, exchange = f.at["tokens"], f.diff["tokens"], ev.decisions[f.arm].exchange_median
        line = f"  {f.arm}: held-out pass@1 {at.mean:.3f} [{at.low:.3f}, {at.high:.3f}]"
        if diff is not None:
            line += f"; vs {ev.base_arm} {diff.mean:+.3f} [{diff.low:+.3f}, {diff.high:+.3f}]"
        if exchange is not None:
            line += f"; token exchange {exchange:.2f}x ({ev.base_arm}'s tokens for the same pass@1 over its own)"
        lines.append(line)
    return lines


def summary_lines(store, runs: list[Planned]) -> list[str]:
    """Per arm: held-out pass@1 of the final checkpoints, mean and 95% two-way bootstrap interval over seeds
    and prompts, mean generated tokens; and each arm's paired difference to the first arm (`uniform` when it
    is in the comparison)."""
    from tasks.core.stats import bootstrap_mean, paired_difference

    arms = list(dict.fromkeys(r.arm for r in runs))
    base = "uniform" if "uniform" in arms else arms[0]
    by_arm = {a: [r.run_id for r in sorted((r for r in runs if r.arm == a), key=lambda r: r.seed)] for a in arms}
    mats = {a: final_matrix(store, ids) for a, ids in by_arm.items()}
    lines = []
    for a in arms:
        x, tokens = mats[a]
        iv = bootstrap_mean(x)
        line = (f"{a}: held-out pass@1 {iv.mean:.3f} [{iv.low:.3f}, {iv.high:.3f}] over {iv.seeds} seed(s) x "
                f"{iv.prompts} prompts, {np.mean(tokens):.0f} generated tokens per run")
        if a != base and mats[a][0].shape == mats[base][0].shape:
            d = paired_difference(x, mats[base][0])
            line += f"; vs {base} {d.mean:+.3f} [{d.low:+.3f}, {d.high:+.3f}]"
        lines.append(line)
    return lines
