"""Does the refined curriculum beat uniform GRPO at equal compute? One command runs (or resumes) the
comparison and regenerates docs/evidence.md and its plots from the store (issue 15):

    python benchmarks/evidence.py --store evidence-store --run     # run or resume, then write the page
    python benchmarks/evidence.py --store evidence-store           # only rewrite the page from the store
    python benchmarks/evidence.py --store evidence-store --partial # the page from the runs finished so far

The design is fixed here, so every regeneration describes the same experiment:
- the core arms `uniform`, `dapo_filter`, `eps_kmeans`, `refinery` at `--seeds` paired seeds (default 3),
  and the four ablations (`no_refine`, `no_shape`, `no_fewshot`, `no_lope`) at `--ablation-seeds` (default
  1), paired with `refinery`'s first seeds; `--confirm ABLATION` runs one of them at `--seeds` seeds instead,
  the check a default change needs (`--confirm no_lope --run` adds `no_lope`'s seeds 1 and 2); or, with
  `--arms A,B`, only those arms at `--seeds` (issue 49's calibration run is `--arms uniform,default --seeds 4
  --run`; `default` is the shipped defaults, tasks/compare/arms.py); `--estimate` prints what the unfinished runs
  would cost first;
- one shared config, benchmarks/evidence.toml (the embedded default policy, a pool of five strata with a
  quarter of each stratum's twin groups, 403 prompts, held out by the stratified split, a generated-token
  budget), plus any `--set` overrides;
- the external sets data/external/reasoning_gym_ood.jsonl and in_family_harder.jsonl (300 prompts each, made
  once by data/external/make_external.py), scored on every run's checkpoint at its largest milestone within
  the budget, its last checkpoint and the base model (flows/compare.py); the page reads them at the matched
  budget where every run has that checkpoint scored, else at the last (tasks/compare/external.py);
- the design's budgets `--budgets` (60k and 120k generated tokens: pass@1 where every run reached them, else
  "not reached").
Two at a time, one per core (a 2-core machine runs one torch job per core; issue 50's v3 ran its last seeds so):
give each core a store of its own and the runs it makes, then merge them into one by run id,

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/evidence.py --store A --arms ... --run --only ev-uniform-s0,...
    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/evidence.py --store B --arms ... --run --only ev-uniform-s1,...
    python benchmarks/evidence.py --store A --arms ... --merge-from B --partial

(each run is made exactly as the whole comparison makes it, and a part ends without a page; the store holding
the plan's first run scores the base model on the external sets; a merge takes the runs finished and scored
there, refuses runs of another design before copying anything, and evidence_design.py `merge_runs` says what
it copies and refuses).
Runs go one after the other through flows/compare.py (`refinery compare` does the same for any arms); the page
is tasks/compare/page.py over the queries of tasks/compare/figures.py. Before writing, every run's stored config
is checked against the design (the shared config, `--set`, its arm and seed): a store whose runs were made
otherwise is refused, naming the run and the fields; and so is one whose runs come from more than one commit or
from code with uncommitted changes (flows/compare.py `mixed_code`), unless `--allow-mixed`, when the page says so
in its first lines. The page and `--json` (`commits`, `dirty_runs`) name the commits its runs were made at.
Runs made in different arithmetic (bf16 and fp32: `model.dtype`, where "auto" follows the CPU's native bf16)
are named in a warning first too (evidence_design.py `mixed_arithmetic`), not refused: the runs are made.
`--json PATH` writes the page's headline figures (tasks/compare/headline.py): issue 49's `heldout_prompts`,
`heldout_strata`, `eval_token_share`, and per arm under `arms` `pass1_at_budget`, `vs_uniform`,
`relative_vs_uniform`, `paired_seeds`, `seed_test_p`, `power_seeds_needed`, `informative_ratio`, the area
under the curve, the token exchange (`token_exchange`: uniform's tokens over the arm's for the same pass@1) and
the matched steps and seconds of its pair with `uniform` (tasks/compare/decide.py).
benchmarks/evidence_reading.md (or `--reading PATH`), where it exists, is a hand-written reading of the figures
(which part hurts, what changed and why); the page puts it under the generated verdict. It is dated and says
which runs it read, since the tables regenerate and it does not. Each committed comparison keeps its own
(`benchmarks/evidence_reading_v1.md`, `evidence_reading_v2.md`, `evidence_reading_v3.md` for the earlier pages,
docs/evidence-v1.md, docs/evidence-v2.md and docs/evidence-v3.md).
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run as a script, benchmarks/select.py would shadow the standard library's `select`

import argparse  # noqa: E402
import json  # noqa: E402
from datetime import UTC, datetime  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.evidence_design import (  # noqa: E402
    check_design,
    commit,
    design,
    estimate,
    externally_scored,
    finished,
    machine,
    machines,
    merge_runs,
    mixed_arithmetic,
    record_machine,
)

CORE = ["uniform", "dapo_filter", "eps_kmeans", "refinery"]
ABLATIONS = ["no_refine", "no_shape", "no_fewshot", "no_lope"]
CONFIG = REPO / "benchmarks" / "evidence.toml"
DATASETS = [REPO / "data" / "external" / name  # made once by data/external/make_external.py
            for name in ("reasoning_gym_ood.jsonl", "in_family_harder.jsonl")]
READING = REPO / "benchmarks" / "evidence_reading.md"  # the hand-written reading of the figures, put under the verdict
PREFIX = "ev"
BUDGETS = (60_000, 120_000)  # the design's budgets (issue 49, item 5): 120k is the 60k runs resumed to twice the budget


def arm_groups(seeds: int, ablation_seeds: int, confirmed: list[str]) -> list[tuple[list[str], int]]:
    """(arms, seeds) in the order they run: the core arms, the ablations at `ablation_seeds`, then the
    confirmed ablations at `seeds`.

    >>> arm_groups(3, 1, ["no_lope"])[1:]
    [(['no_refine', 'no_shape', 'no_fewshot'], 1), (['no_lope'], 3)]
    """
    single = [arm for arm in ABLATIONS if arm not in confirmed]
    return [(arms, n) for arms, n in ((CORE, seeds), (single, ablation_seeds), (list(confirmed), seeds)) if arms]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True, help="the comparison's store (a folder or s3:// root)")
    ap.add_argument("--run", action="store_true", help="run or resume the comparison before writing the page")
    ap.add_argument("--partial", action="store_true", help="write the page from the finished runs only")
    ap.add_argument("--estimate", action="store_true", help="print what the planned runs not finished yet would "
                    "cost (generated tokens, hours at the rate this store's finished runs had) and stop")
    ap.add_argument("--arms", default=None, metavar="A,B",
                    help="only these arms, each at --seeds paired seeds, no ablations (e.g. `--arms uniform,default "
                    "--seeds 4`, issue 49's calibration run); default: the core arms and the ablations")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--ablation-seeds", type=int, default=1)
    ap.add_argument("--confirm", action="append", default=[], choices=ABLATIONS, metavar="ABLATION",
                    help="run this ablation at --seeds paired seeds, like a core arm (repeat for more): the check "
                    "a default change needs before it is made")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)), metavar="N,N",
                    help="generated-token budgets of the design at which pass@1 is read where every run reached "
                    "them (default %(default)s)")
    ap.add_argument("--out", default=str(REPO / "docs" / "evidence.md"))
    ap.add_argument("--reading", default=None, metavar="MD", help="the hand-written reading to put under the "
                    "verdict (default benchmarks/evidence_reading.md; a missing file puts none)")
    ap.add_argument("--config", default=str(CONFIG), help="the shared design (default benchmarks/evidence.toml; the "
                    "committed store's runs were made with benchmarks/evidence_v1.toml)")
    ap.add_argument("--dataset", action="append", default=None, metavar="JSONL",
                    help="an external set scored on every run (repeat for more; default: "
                    + ", ".join(str(p.relative_to(REPO)) for p in DATASETS) + ")")
    ap.add_argument("--json", default=None, help="write the headline figures here (tasks/compare/headline.py)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="an override shared by every run, on top of benchmarks/evidence.toml")
    ap.add_argument("--only", default=None, metavar="RUN,RUN", help="with --run: run only these planned runs, "
                    "each as the whole comparison runs it, so that parts of it can run at once in separate stores "
                    "(one per core) and be merged with --merge-from")
    ap.add_argument("--merge-from", default=None, metavar="STORE", help="first copy finished runs from this local "
                    "store of the same comparison into --store (the runs of --only, else every planned run "
                    "finished there and not here): each run's folders, the shared ingest stages, where it ran")
    ap.add_argument("--allow-mixed", action="store_true", help="write the page (and run) although its runs come "
                    "from more than one commit or from uncommitted code; the page then says so in its first lines")
    a = ap.parse_args(argv)
    for flag, path in (("--out", a.out), ("--json", a.json)):
        if path and Path(path).is_dir():  # checked before any run: the page is written after hours of them
            print(f"evidence: {flag} {path} is a folder; give the file to write (e.g. {Path(path) / 'evidence.md'})",
                  file=sys.stderr)
            return 2
    if a.only is not None and not a.run and not a.merge_from:
        print("evidence: --only names the runs to --run or to take with --merge-from; give one of them",
              file=sys.stderr)
        return 2
    if a.reading and not Path(a.reading).is_file():
        print(f"evidence: --reading {a.reading} is not a file (the hand-written reading to put on the page)",
              file=sys.stderr)
        return 2
    try:
        return _main(a)
    except ValueError as e:  # a store that does not fit the design, a bad override, a run not evaluated
        print(f"evidence: {e}", file=sys.stderr)
        return 1


def _groups(a: argparse.Namespace) -> tuple[list[tuple[list[str], int]], str]:
    """(arms, seeds) groups in run order, and the page's sentence saying so."""
    if a.arms:
        arms = [x.strip() for x in a.arms.split(",") if x.strip()]
        if a.confirm:
            raise ValueError("--confirm adds an ablation to the default arms: leave it out with --arms")
        return [(arms, a.seeds)], f"Arms {', '.join(f'`{x}`' for x in arms)} at {a.seeds} paired seed(s)"
    a.confirm = list(dict.fromkeys(a.confirm))
    return (arm_groups(a.seeds, a.ablation_seeds, a.confirm),
            f"Core arms at {a.seeds} paired seed(s), ablations at {a.ablation_seeds}"
            f"{''.join(f', `{arm}` at {a.seeds}' for arm in a.confirm)}")


def _budgets(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--budgets {text!r}: expected generated-token counts separated by commas") from None
    if any(b <= 0 for b in out):
        raise ValueError(f"--budgets {text!r}: every budget must be a positive number of tokens")
    return out


def _main(a: argparse.Namespace) -> int:
    from flows.compare import plan
    from storage.store import Store
    from tasks.compare.page import build, markdown
    from tasks.compare.plots import plots

    datasets = a.dataset or [str(p) for p in DATASETS]
    groups, seeds_text = _groups(a)
    budgets = _budgets(a.budgets)
    planned = [r for arms, seeds in groups for r in plan(arms, seeds, PREFIX, a.set, {})]
    if a.estimate:
        print("\n".join(estimate(Store(a.store), planned, a.config, a.set)))
        return 0
    only = [x.strip() for x in a.only.split(",") if x.strip()] if a.only is not None else None
    planned_ids = [r.run_id for r in planned]
    if only is not None and (unknown := [r for r in only if r not in planned_ids]):
        raise ValueError(f"--only {', '.join(unknown)}: not a planned run of this comparison (planned: "
                         f"{', '.join(planned_ids)})")
    if a.merge_from:
        source = Store(a.merge_from)
        here = finished(Store(a.store), planned_ids)
        names = [Path(p).stem for p in datasets]
        ready = finished(source, planned_ids)
        ready &= externally_scored(source, sorted(ready), names)  # a finished run is scored on them last
        runs = only if only is not None else sorted(ready - here)
        check_design(source, [r for r in planned if r.run_id in set(runs) & ready], a.config, [])  # before a copy
        merged = merge_runs(source, Store(a.store), runs, names)
        print(f"evidence: merged {len(merged)} run(s) from {a.merge_from}: {', '.join(merged) or 'none'}",
              flush=True)
    if a.run:
        from flows.compare import prepare_comparison, run_comparison
        from flows.server.prefect_setup import prepare_prefect

        prepare_prefect(a.store, verbose=False)
        for arms, seeds in groups:
            comparison = prepare_comparison(arms, seeds, PREFIX, a.set, {}, None, a.store, a.config, datasets,
                                            a.allow_mixed)
            mine = None if only is None else [r for r in only if r in {p.run_id for p in comparison.runs}]
            if mine == []:
                continue
            run_comparison(comparison, lambda r: (print(f"evidence: {r.run_id} (arm {r.arm}, seed {r.seed})",
                                                        flush=True), record_machine(a.store, r.run_id)), mine)
    store = Store(a.store)
    done = finished(store, [r.run_id for r in planned])
    missing = [r.run_id for r in planned if r.run_id not in done]
    if missing and not a.partial and (only is not None or a.merge_from):  # a part of the comparison, as asked
        print(f"evidence: {len(missing)} planned run(s) not in {a.store} yet (first: {missing[0]}); the page waits "
              "for them (or --partial)", flush=True)
        return 0
    if missing and not a.partial:
        print(f"evidence: {len(missing)} planned run(s) not finished (first: {missing[0]}); pass --run to run "
              "them, or --partial for a page of the finished ones", file=sys.stderr)
        return 2
    planned = [r for r in planned if r.run_id in done]
    if not any(r.arm == "uniform" for r in planned):
        print("evidence: no finished `uniform` run to compare against yet", file=sys.stderr)
        return 2
    check_design(store, planned, a.config, [])  # r.sets already hold --set
    from flows.compare import code_of_runs, mixed_code

    mixed = mixed_code(store, [r.run_id for r in planned], False, a.allow_mixed)  # refused unless --allow-mixed
    commits, dirty_runs = code_of_runs(store, [r.run_id for r in planned])
    arithmetic = mixed_arithmetic(store, [r.run_id for r in planned])  # said first, not refused: the runs are made
    names = [Path(p).stem for p in datasets]
    ev = build(store, PREFIX, planned, names, design_budgets=budgets)
    out = Path(a.out)
    figures = out.parent / out.stem
    figures.mkdir(parents=True, exist_ok=True)
    for name, fig in plots(ev).items():
        fig.savefig(figures / f"{name}.png")
    how = (f" --arms {a.arms} --seeds {a.seeds}" if a.arms else "") + "".join(f" --confirm {c}" for c in a.confirm)
    how += "".join(f" --set '{x}'" for x in a.set)
    config = Path(a.config).resolve()
    if config != CONFIG.resolve():
        how += f" --config {config.relative_to(REPO) if config.is_relative_to(REPO) else a.config}"
    if a.reading:
        how += f" --reading {a.reading}"
    header = "\n".join([
        "# Evidence: the refined curriculum against uniform GRPO at equal generated tokens", "",
        *([f"**Warning, {mixed}**: the arms may differ by code as well as by design; read every difference "
           "with that in mind (`--allow-mixed`).", ""] if mixed else []),
        *([f"**Warning, {arithmetic}**.", ""] if arithmetic else []),
        f"The runs on this page were made at commit{'s' if len(commits) > 1 else ''} "
        f"{', '.join(f'`{c[:12]}`' for c in commits)}"
        f"{f'; with uncommitted changes: {len(dirty_runs)} run(s)' if dirty_runs else ', with no uncommitted changes'}.",
        "",
        f"Generated by `python benchmarks/evidence.py --store STORE{how}"
        f"{' --partial' if missing else ''}` on "
        f"{datetime.now(UTC):%Y-%m-%d} at commit {commit()}; do not edit by hand. Page written on: {machine()}.",
        "", "Where each run ran (its last start; wall-clock figures compare only runs of one machine):", "",
        *machines(store, [r.run_id for r in planned]),
        "", "Held-out pass@1 is measured at the largest budget every run reached (generated tokens: rollouts, "
        "discarded rollouts, LoPE resamples, teacher answers, MCMC proposals, reserve rescoring; evaluation "
        "not counted), interpolated per prompt between the two checkpoints around it; intervals are 95% "
        "two-way bootstraps over seeds and prompts, differences paired by seed (docs/algorithms.md, "
        "comparison). Wall-clock seconds include the held-out evaluations of earlier checkpoints and whatever "
        "else ran on the machine at the time: read them as rough."])
    reading_file = Path(a.reading) if a.reading else READING
    reading = reading_file.read_text(encoding="utf-8") if reading_file.exists() else ""
    page = markdown(ev, names, header, design(planned, missing, seeds_text, a.set, Path(a.config),
                                              [Path(d) for d in datasets]), reading, figures=out.stem)
    out.write_text(page, encoding="utf-8")
    print(f"evidence: wrote {out} and its plots in {figures}")
    if a.json:
        from tasks.compare.headline import headline

        Path(a.json).write_text(json.dumps(headline(ev, commits, dirty_runs), indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
