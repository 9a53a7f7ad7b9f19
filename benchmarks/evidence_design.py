"""The design side of benchmarks/evidence.py: where each run ran, the commit the page was written at, which runs
finished, the check that every stored run was made with the design, and the page's "experiment" section (the
arms, their overrides and run ids, the shared config, the external sets). Split from the script so that it
stays a readable entry point; `python benchmarks/evidence.py` is still the one command.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


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


def last_machines(store) -> dict[str, str]:
    """run id -> the machine of its last start in <store>/_machines.jsonl (where it finished)."""
    path = store.path("_machines.jsonl")
    where: dict[str, str] = {}
    if store.fs.exists(path):
        for line in store.fs.cat_file(path).decode().splitlines():
            if line.strip():
                rec = json.loads(line)
                where[rec["run_id"]] = rec["machine"]
    return where


def machines(store, run_ids: list[str]) -> list[str]:
    """'machine: run ids' lines for the finished runs, from <store>/_machines.jsonl (runs made before it
    existed are listed as unrecorded)."""
    where = last_machines(store)
    by_machine: dict[str, list[str]] = {}
    for r in run_ids:
        by_machine.setdefault(where.get(r, "not recorded"), []).append(r)
    return [f"- {m}: {', '.join(f'`{r}`' for r in rs)}" for m, rs in by_machine.items()]


def mixed_arithmetic(store, run_ids: list[str]) -> str | None:
    """One line when the runs decoded, evaluated and trained in different arithmetic, else None. A run's
    arithmetic is its config's `model.dtype`, where "auto" is read off the machine it last started on
    (_machines.jsonl: bf16 with native bf16, else fp32). Greedy evaluation is not the same instrument in both:
    in evidence v5 the base model scored 0.263 decoded in fp32 against 0.280 in bf16 (19 of 403 answers
    differed), so a pair across the two mixes instruments as well as seeds."""
    from storage.runs import stored_config

    where = last_machines(store)
    kinds: dict[str, list[str]] = {}
    for r in run_ids:
        dtype = (stored_config(store, r) or {}).get("model", {}).get("dtype", "auto")
        if dtype == "auto":
            if r not in where:
                continue  # not recorded: nothing to say
            dtype = "fp32" if "native bf16: no;" in where[r] else "bf16"  # as machine() writes it
        kinds.setdefault(dtype, []).append(r)
    if len(kinds) < 2:
        return None
    parts = [f"{len(rs)} in {k} ({', '.join(f'`{r}`' for r in rs[:3])}{' ...' if len(rs) > 3 else ''})"
             for k, rs in sorted(kinds.items(), key=lambda kv: -len(kv[1]))]
    return (f"mixed arithmetic: of the runs, {'; '.join(parts)} (their `model.dtype`, \"auto\" read off the "
            "machine each ran on): greedy evaluations differ between bf16 and fp32, so a pair across them mixes "
            "instruments as well as seeds")


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


def _shown(p: Path) -> str:
    """A path as the page names it: relative to the repository where it lies inside."""
    p = Path(p).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)


def design(planned, missing, seeds_text: str, sets, config: Path, datasets: list[Path]) -> str:
    """The page's "experiment" section; `seeds_text` says which arms ran at how many seeds."""
    from tasks.compare.arms import ARMS, SEEDED

    lines = ["## The experiment", "",
             f"Arms (tasks/compare/arms.py; an arm is a list of config overrides on the shared config). {seeds_text}. "
             f"Seed s sets "
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
              "its generator script beside it). It scores each run's checkpoint at its largest generated-token "
              "milestone within the budget, its last checkpoint and the base model (flows/compare.py); its "
              "`near` prompts are pool tasks at levels the pool never uses, `far` ones tasks it never uses."]
    return "\n".join(lines)



def estimate(store, planned, config: str, shared: list[str]) -> list[str]:
    """What the planned runs not finished yet would cost (issue 49, item 7): each runs to its token budget
    (`max_generated_tokens`; its last round is fitted to what is left, tasks/core/budget.py), plus evaluation at the share and in the
    seconds per generated token that this store's finished runs of the plan had. A rough guide before `--run`;
    the page prints what the runs did cost."""
    import polars as pl

    from flows.config import load_config
    from tasks.compare.figures import eval_token_share, frame

    ids = [r.run_id for r in planned]
    try:
        done = finished(store, ids)
        tokens = frame(store, "TOKENS", "ev").filter(pl.col("run_id").is_in(sorted(done)))
        runtime = frame(store, "RUNTIME", "ev").filter(pl.col("run_id").is_in(sorted(done)))
    except Exception:  # noqa: BLE001 - a new or empty store: nothing measured yet
        done, tokens, runtime = set(), None, None
    todo = [r for r in planned if r.run_id not in done]
    budget = sum(load_config(config, sets=[*shared, *r.sets], run_id=r.run_id).max_generated_tokens or 0
                 for r in todo)
    lines = [f"evidence: {len(planned)} planned run(s), {len(done)} finished, {len(todo)} to run: "
             f"{budget / 1e6:.2f}M generated tokens of training budget"]
    if tokens is None or tokens.height == 0 or runtime.height == 0:
        lines.append("evidence: no finished run in this store to measure evaluation's share or the time per "
                     "token from: no estimate of hours")
        return lines
    share = eval_token_share(tokens)
    per_token = float(runtime["seconds"].sum()) / float(tokens["tokens"].sum())
    total = budget / (1 - share) if share < 1 else float("inf")
    lines.append(f"evidence: with evaluation at {share:.0%} of generated tokens (as in the {len(done)} finished "
                 f"run(s)) {total / 1e6:.2f}M tokens in all, about {total * per_token / 3600:.1f} hours at "
                 f"{per_token * 1000:.1f} s per 1k tokens")
    return lines


MERGE_SKIPS = {"_checkpoints", "_reports", ".tmp", ".locks", ".prefect"}  # weights, reports, temporaries: not data


def _same_files(a: Path, b: Path) -> bool:
    """Two folders holding the same relative paths with the same bytes."""
    import filecmp

    files = {str(f.relative_to(a)) for f in a.rglob("*") if f.is_file()}
    if files != {str(f.relative_to(b)) for f in b.rglob("*") if f.is_file()}:
        return False
    return all(filecmp.cmp(a / f, b / f, shallow=False) for f in files)


def externally_scored(store, run_ids: list[str], datasets: list[str]) -> set[str]:
    """The runs of `run_ids` whose newest evaluated checkpoint is scored on every external set of `datasets`
    (names): the last thing a comparison does for a run, after its `runs` row says completed."""
    import polars as pl

    from storage.query import scan

    evals = scan(store, "evals").filter(pl.col("run_id").is_in(run_ids)).select(
        "run_id", "split", "policy_version").collect()
    newest = evals.group_by("run_id").agg(pl.col("policy_version").max().alias("newest"))
    scored = evals.join(newest, on="run_id").filter(pl.col("policy_version") == pl.col("newest"))
    have = scored.group_by("run_id").agg(pl.col("split"))
    return {r for r, splits in have.iter_rows() if all(f"dataset:{d}" in splits for d in datasets)}


def merge_runs(source, target, run_ids: list[str], datasets: list[str] = ()) -> list[str]:
    """Copy finished runs from `source` into `target` (two local stores of one comparison, each run made in one
    of them: `benchmarks/evidence.py --run --only`), so that runs can go at once, one per core, and meet in one
    store. First what is harmless alone: the shared `run_id=_ingest` stage files the target lacks (their names
    hash their content: one name is one stage) and the runs' `_machines.jsonl` lines. Then per run, its
    `run_id=<run>` folder of every table (`_landed` included), copied into a temporary folder the target's
    cleanup leaves alone and moved into place under the target's commit lock, data first, `runs` and `_landed`
    (what makes the run readable and finished) last. Weights and reports stay behind. A run whose folders are
    already in the target with the same bytes (a merge that stopped part way, run again) is completed, not
    refused; one whose folders there differ, one not finished in the source, or (with `datasets`, external
    sets' names) one whose newest checkpoint is not scored on them there yet, is refused before anything is
    copied. Returns the runs that were not already whole in the target."""
    import shutil

    src, dst = Path(source.root), Path(target.root)
    for store in (source, target):
        protocol = store.fs.protocol
        if "file" not in (protocol if isinstance(protocol, tuple) else (protocol,)):
            raise ValueError(f"merging runs needs local stores; {store.root} is not one")
    if src.resolve() == dst.resolve():
        raise ValueError(f"merging runs: source and target are the same store ({src})")
    done = finished(source, run_ids)
    if missing := [r for r in run_ids if r not in done]:
        raise ValueError(f"merging runs: {', '.join(missing)} not finished in {src}")
    if datasets and (unscored := [r for r in run_ids if r not in externally_scored(source, run_ids, list(datasets))]):
        raise ValueError(f"merging runs: {', '.join(unscored)} not scored on the external sets in {src} yet "
                         "(its comparison is still evaluating it)")
    tables = sorted((p.name for p in src.iterdir() if p.is_dir() and p.name not in MERGE_SKIPS),
                    key=lambda t: (t == "_landed", t == "runs", t))  # what marks a run finished goes last
    todo: dict[str, list[str]] = {}
    for run in run_ids:
        for table in tables:
            part, there = src / table / f"run_id={run}", dst / table / f"run_id={run}"
            if part.is_dir() and there.exists() and not _same_files(there, part):
                raise ValueError(f"merging runs: {run} is in {dst} already ({table}) with other files; "
                                 "remove it there or leave it out")
            if part.is_dir() and not there.exists():
                todo.setdefault(run, []).append(table)
    for table in tables:  # shared stages and where the runs ran: harmless before the runs' own rows
        shared = src / table / "run_id=_ingest"
        for f in (shared.rglob("*") if shared.is_dir() else []):
            to = dst / f.relative_to(src)
            if f.is_file() and not to.exists():
                to.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, to.with_name(to.name + ".part"))
                os.replace(to.with_name(to.name + ".part"), to)
    lines = (src / "_machines.jsonl").read_text().splitlines() if (src / "_machines.jsonl").exists() else []
    have = set((dst / "_machines.jsonl").read_text().splitlines()) if (dst / "_machines.jsonl").exists() else set()
    new = [ln for ln in lines if ln.strip() and json.loads(ln)["run_id"] in run_ids and ln not in have]
    if new:
        with open(dst / "_machines.jsonl", "a") as out:
            out.write("".join(ln + "\n" for ln in new))
    for run, parts in todo.items():
        stage = Path(target._claim_tmp())
        try:
            for table in parts:
                shutil.copytree(src / table / f"run_id={run}", stage / table)
            with target.lock("commit"):  # the target's cleanup scans under it: it never sees half a run
                for table in parts:
                    (dst / table).mkdir(parents=True, exist_ok=True)
                    os.replace(stage / table, dst / table / f"run_id={run}")
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    return list(todo)
