"""Does the refined curriculum beat uniform GRPO at equal compute? One command runs (or resumes) the
comparison and regenerates docs/evidence.md and its plots from the store (issue 15):

    python benchmarks/evidence.py --store evidence-store --run     # run or resume, then write the page
    python benchmarks/evidence.py --store evidence-store           # only rewrite the page from the store
    python benchmarks/evidence.py --store evidence-store --partial # the page from the runs finished so far

The design is fixed here, so every regeneration describes the same experiment:
- the core arms `uniform`, `dapo_filter`, `eps_kmeans`, `refinery` at `--seeds` paired seeds (default 3),
  and the four ablations (`no_refine`, `no_shape`, `no_fewshot`, `no_lope`) at `--ablation-seeds` (default
  1), paired with `refinery`'s first seeds; `--confirm ABLATION` runs one of them at `--seeds` seeds instead,
  the check a default change needs (`--confirm no_lope --run` adds `no_lope`'s seeds 1 and 2);
- one shared config, benchmarks/evidence.toml (the embedded default policy, a pool of five strata with a
  quarter of each stratum's twin groups, 403 prompts, held out by the stratified split, a generated-token
  budget), plus any `--set` overrides;
- the external sets data/external/reasoning_gym_ood.jsonl and in_family_harder.jsonl (300 prompts each, made
  once by data/external/make_external.py), scored on every run's last checkpoint and the base model
  (flows/compare.py; at the matched budget is issue 49's item 6, not yet plumbed).
Runs go one after the other through flows/compare.py (`refinery compare` does the same for any arms); the page
is tasks/compare/page.py over the queries of tasks/compare/figures.py. Before writing, every run's stored config
is checked against the design (the shared config, `--set`, its arm and seed): a store whose runs were made
otherwise is refused, naming the run and the fields; and so is one whose runs come from more than one commit or
from code with uncommitted changes (flows/compare.py `mixed_code`), unless `--allow-mixed`, when the page says so
in its first lines. The page and `--json` (`commits`, `dirty_runs`) name the commits its runs were made at. `--json PATH` writes the headline figures as flat keys.
benchmarks/evidence_reading.md, where it exists, is a hand-written reading of the figures (which part hurts,
what changed and why); the page puts it under the generated verdict. It is dated and says which runs it read,
since the tables regenerate and it does not.
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run as a script, benchmarks/select.py would shadow the standard library's `select`

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
from datetime import UTC, datetime  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CORE = ["uniform", "dapo_filter", "eps_kmeans", "refinery"]
ABLATIONS = ["no_refine", "no_shape", "no_fewshot", "no_lope"]
CONFIG = REPO / "benchmarks" / "evidence.toml"
DATASETS = [REPO / "data" / "external" / name  # made once by data/external/make_external.py
            for name in ("reasoning_gym_ood.jsonl", "in_family_harder.jsonl")]
READING = REPO / "benchmarks" / "evidence_reading.md"  # the hand-written reading of the figures, put under the verdict
PREFIX = "ev"


def machine() -> str:
    cpu, flags = platform.processor() or "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    native = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    import torch

    return (f"{cpu}, {os.cpu_count()} cores visible, native bf16: {', '.join(native) or 'no'}; "
            f"Python {platform.python_version()}, torch {torch.__version__}, {torch.get_num_threads()} threads")


OWN_OUTPUTS = ("benchmarks/evidence/store/", "docs/evidence")  # what this script writes: not a code change


def commit() -> str:
    """HEAD, marked when tracked files other than this script's own outputs (the store's machine records, the
    page and its plots) have uncommitted changes."""
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True).stdout.splitlines()
        dirty = [line for line in status if not line[3:].startswith(OWN_OUTPUTS)]
        return out + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def record_machine(store_uri: str, run_id: str) -> None:
    """Append where `run_id` runs (or resumes) to <store>/_machines.jsonl: a comparison made over several
    sessions may run its arms on different CPUs, and the page says which run ran where."""
    from storage.store import Store

    store = Store(store_uri)
    if finished(store, [run_id]):
        return  # completed earlier (maybe elsewhere): compare skips it, and it keeps its record
    line = json.dumps({"run_id": run_id, "host": platform.node(), "machine": machine(), "commit": commit(),
                       "started": f"{datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ}"})
    path = store.path("_machines.jsonl")
    store.fs.makedirs(store.root, exist_ok=True)
    before = store.fs.cat_file(path).decode() if store.fs.exists(path) else ""  # object stores cannot append
    with store.fs.open(path, "w") as f:
        f.write(before + line + "\n")


def machines(store, run_ids: list[str]) -> list[str]:
    """'machine: run ids' lines for the finished runs, from <store>/_machines.jsonl (runs made before it
    existed are listed as unrecorded)."""
    path = store.path("_machines.jsonl")
    where: dict[str, str] = {}
    if store.fs.exists(path):
        for line in store.fs.cat_file(path).decode().splitlines():
            if line.strip():
                rec = json.loads(line)
                where[rec["run_id"]] = rec["machine"]  # the last start: where it finished
    by_machine: dict[str, list[str]] = {}
    for r in run_ids:
        by_machine.setdefault(where.get(r, "not recorded"), []).append(r)
    return [f"- {m}: {', '.join(f'`{r}`' for r in rs)}" for m, rs in by_machine.items()]


def finished(store, run_ids: list[str]) -> set[str]:
    import polars as pl

    from storage.query import scan

    runs = scan(store, "runs").filter(pl.col("run_id").is_in(run_ids)).collect()
    last = runs.sort("created_at").group_by("run_id").agg(pl.col("status").last())
    return set(last.filter(pl.col("status") == "completed")["run_id"].to_list())


def check_design(store, planned, config: str, shared: list[str]) -> None:
    """Raise ValueError naming the first run whose stored config is not the design's for it (resumable fields
    such as `rounds` and `max_generated_tokens` aside: flows/curriculum.py)."""
    from flows.config import load_config
    from flows.curriculum import check_resume
    from storage.runs import stored_config

    for r in planned:
        want = load_config(config, sets=[*shared, *r.sets], run_id=r.run_id, store=store.uri)
        try:
            check_resume(want, stored_config(store, r.run_id) or {})
        except ValueError as e:
            raise ValueError(f"{r.run_id} was not run with this design: {str(e).split('(', 1)[-1].split(')')[0]}"
                             ) from None


def arm_groups(seeds: int, ablation_seeds: int, confirmed: list[str]) -> list[tuple[list[str], int]]:
    """(arms, seeds) in the order they run: the core arms, the ablations at `ablation_seeds`, then the
    confirmed ablations at `seeds`.

    >>> arm_groups(3, 1, ["no_lope"])[1:]
    [(['no_refine', 'no_shape', 'no_fewshot'], 1), (['no_lope'], 3)]
    """
    single = [arm for arm in ABLATIONS if arm not in confirmed]
    return [(arms, n) for arms, n in ((CORE, seeds), (single, ablation_seeds), (list(confirmed), seeds)) if arms]


def _shown(p: Path) -> str:
    """A path as the page names it: relative to the repository where it lies inside."""
    p = Path(p).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)


def design(planned, missing, seeds, ablation_seeds, sets, confirmed=(), config: Path = CONFIG,
           datasets: list[Path] = DATASETS) -> str:
    from flows.compare import ARMS, SEEDED

    lines = ["## The experiment", "",
             f"Arms (flows/compare.py; an arm is a list of config overrides on the shared config). Core arms at "
             f"{seeds} paired seed(s), ablations at {ablation_seeds}"
             f"{''.join(f', `{arm}` at {seeds}' for arm in confirmed)}. Seed s sets "
             f"{', '.join(f'`{k}`' for k in SEEDED)} to s in every arm, so arms pair by seed; the pool, its "
             "held-out split and the evaluation's sampling are the same in every run.", "",
             "| arm | overrides | run ids |", "|---|---|---|"]
    for arm in dict.fromkeys(r.arm for r in planned):
        ids = ", ".join(f"`{r.run_id}`" for r in planned if r.arm == arm)
        lines.append(f"| `{arm}` | {'; '.join(f'`{o}`' for o in ARMS[arm]) or '(none: the shared config)'} | {ids} |")
    if missing:
        lines += ["", f"Not finished when this page was written, so left out: {', '.join(f'`{m}`' for m in missing)}."]
    lines += ["", f"Shared config ({_shown(config)}):", "", "```toml", config.read_text().strip(), "```",
              *(["", "Shared overrides (`--set`): " + ", ".join(f"`{x}`" for x in sets)] if sets else []),
              "", "External set: " + ", ".join(_shown(p) for p in datasets) + " (how it was made: "
              "its generator script beside it). It scores each run's last checkpoint and the base model; its "
              "`near` prompts are pool tasks at levels the pool never uses, `far` ones tasks it never uses."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True, help="the comparison's store (a folder or s3:// root)")
    ap.add_argument("--run", action="store_true", help="run or resume the comparison before writing the page")
    ap.add_argument("--partial", action="store_true", help="write the page from the finished runs only")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--ablation-seeds", type=int, default=1)
    ap.add_argument("--confirm", action="append", default=[], choices=ABLATIONS, metavar="ABLATION",
                    help="run this ablation at --seeds paired seeds, like a core arm (repeat for more): the check "
                    "a default change needs before it is made")
    ap.add_argument("--out", default=str(REPO / "docs" / "evidence.md"))
    ap.add_argument("--config", default=str(CONFIG), help="the shared design (default benchmarks/evidence.toml; the "
                    "committed store's runs were made with benchmarks/evidence_v1.toml)")
    ap.add_argument("--dataset", action="append", default=None, metavar="JSONL",
                    help="an external set scored on every run (repeat for more; default: "
                    + ", ".join(str(p.relative_to(REPO)) for p in DATASETS) + ")")
    ap.add_argument("--json", default=None, help="write the headline figures here as flat keys")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="an override shared by every run, on top of benchmarks/evidence.toml")
    ap.add_argument("--allow-mixed", action="store_true", help="write the page (and run) although its runs come "
                    "from more than one commit or from uncommitted code; the page then says so in its first lines")
    a = ap.parse_args(argv)
    try:
        return _main(a)
    except ValueError as e:  # a store that does not fit the design, a bad override, a run not evaluated
        print(f"evidence: {e}", file=sys.stderr)
        return 1


def _main(a: argparse.Namespace) -> int:
    from flows.compare import compare, plan
    from storage.store import Store
    from tasks.compare.page import build, markdown
    from tasks.compare.plots import plots

    datasets = a.dataset or [str(p) for p in DATASETS]
    a.confirm = list(dict.fromkeys(a.confirm))
    groups = arm_groups(a.seeds, a.ablation_seeds, a.confirm)
    planned = [r for arms, seeds in groups for r in plan(arms, seeds, PREFIX, a.set, {})]
    if a.run:
        from flows.server.prefect_setup import prepare_prefect

        prepare_prefect(a.store, verbose=False)
        for arms, seeds in groups:
            compare(arms, seeds, PREFIX, a.set, {}, None, a.store, a.config, datasets=datasets,
                    on_run=lambda r: (print(f"evidence: {r.run_id} (arm {r.arm}, seed {r.seed})", flush=True),
                                      record_machine(a.store, r.run_id)), allow_mixed=a.allow_mixed)
    store = Store(a.store)
    done = finished(store, [r.run_id for r in planned])
    missing = [r.run_id for r in planned if r.run_id not in done]
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
    names = [Path(p).stem for p in datasets]
    ev = build(store, PREFIX, planned, names)
    out = Path(a.out)
    figures = out.parent / out.stem
    figures.mkdir(parents=True, exist_ok=True)
    for name, fig in plots(ev).items():
        fig.savefig(figures / f"{name}.png")
    header = "\n".join([
        "# Evidence: the refined curriculum against uniform GRPO at equal generated tokens", "",
        *([f"**Warning, {mixed}**: the arms may differ by code as well as by design; read every difference "
           "with that in mind (`--allow-mixed`).", ""] if mixed else []),
        f"The runs on this page were made at commit{'s' if len(commits) > 1 else ''} "
        f"{', '.join(f'`{c[:12]}`' for c in commits)}"
        f"{f'; with uncommitted changes: {len(dirty_runs)} run(s)' if dirty_runs else ', with no uncommitted changes'}.",
        "",
        f"Generated by `python benchmarks/evidence.py --store STORE{''.join(f' --confirm {c}' for c in a.confirm)}"
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
    reading = READING.read_text(encoding="utf-8") if READING.exists() else ""
    page = markdown(ev, names, header, design(planned, missing, a.seeds, a.ablation_seeds, a.set, a.confirm,
                                              Path(a.config), [Path(d) for d in datasets]), reading)
    out.write_text(page, encoding="utf-8")
    print(f"evidence: wrote {out} and its plots in {figures}")
    if a.json:
        flat = {"heldout_prompts": ev.heldout_prompts, "eval_samples": ev.samples, "commits": commits,
                "dirty_runs": dirty_runs, "eval_token_share": ev.eval_token_share,
                **{f"matched_{k}": v for k, v in ev.budgets.items()}}
        for f in ev.arms:
            flat[f"{f.arm}_pass1_at_tokens"] = f.at["tokens"].mean
            if f.diff["tokens"] is not None:
                flat[f"{f.arm}_vs_{ev.base_arm}_at_tokens"] = f.diff["tokens"].mean
            flat[f"{f.arm}_informative"] = f.informative
            flat[f"{f.arm}_discarded_share"] = f.discarded_share
        Path(a.json).write_text(json.dumps(flat, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
