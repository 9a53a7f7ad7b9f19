"""The `refinery` commands that start work through Prefect: run, compare, ingest, eval, rescore, report, serve.

Prefect is imported lazily, after `prepare_prefect` (flows/server/prefect_setup.py) has pointed its home inside the
store, so that it never scatters state into ~ and commands that need no flow start fast. What can be checked
before a flow starts is (a run's or a comparison's whole config, an ingest source's name, file and rows, the
run an eval or a rescore names and an eval's checkpoint); such an error is a one-line error, printed by
flows/cli/parser.py with its hint. The commands that run flows start Prefect's server as they begin, while they
import and check their input (`early_prefect`); a refused input kills that server at once and undoes the
Prefect home the command made. Prefect's console log and transformers' load bars are off unless -v is given:
Prefect's ERROR records carry the same traceback again (its API log handler still feeds the UI); `run` and
`compare` print a line per finished stage instead."""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import sys
from pathlib import Path

from flows.cli.run_summary import print_summary
from flows.server.prefect_setup import early_prefect, prepare_prefect


class CliError(ValueError):
    """A bad command-line input, found before any work; `hint` is printed on a second line."""

    user_facing = True

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


def _params(pairs: list[str]) -> dict[str, str]:
    out = {}
    for p in pairs:
        if "=" not in p:
            raise ValueError(f"--param {p!r}: expected key=value")
        k, v = p.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def _check_ingest_source(source: str, params: dict) -> None:
    """The source's name, and a file's existence, type and emptiness, before Prefect starts (its rows are
    checked next, while the server starts: flows/ingest.py `check_rows`)."""
    if source.startswith("rg:"):
        from tasks.core.sources import parse_param, rg_config_fields

        rg_config_fields(source[3:])
        for k, v in params.items():
            parse_param(source[3:], k, v)
        return
    path = Path(source)
    if not path.exists():
        raise CliError(f"{source}: no such file", hint="a source is rg:<reasoning-gym task> or a .jsonl/.parquet file")
    if not path.is_file():
        raise CliError(f"{source} is a folder, not a .jsonl or .parquet file")
    if path.suffix.lower() not in (".jsonl", ".parquet"):
        raise CliError(f"{source}: unsupported file type {path.suffix.lower() or '(none)'!r}; use .jsonl or "
                       ".parquet", hint="or rg:<reasoning-gym task>")
    if path.suffix.lower() == ".jsonl" and not _has_text(path):
        raise CliError(f"{source}: no rows (the file is empty or holds only blank lines)")


def _has_text(path: Path, chunk: int = 1 << 16) -> bool:
    import codecs

    with path.open("rb") as f:
        first = True
        while block := f.read(chunk):
            if (block.removeprefix(codecs.BOM_UTF8) if first else block).strip():  # a byte order mark is no row
                return True
            first = False
    return False


class _NothingValid(Exception):
    """A file without a valid row under --skip-invalid: no flow runs, and `args[0]`, its summary, is printed."""


def cmd_ingest(a: argparse.Namespace) -> int:
    """A file's rows are checked before the flow (while Prefect's server starts): a file with a bad row is
    refused without --skip-invalid, leaving the store as it was (or absent). With --skip-invalid, a file whose
    every row is bad is not an error, as the flag asks to skip what is bad: it lands nothing, prints the usual
    summary ("... 0 new prompts landed, ..., N invalid rows skipped") after a `skipped` line per row, exits 0
    and writes nothing, not even Prefect's home. The flow validates the file again (it may have changed)."""
    params = _params(a.param)
    _check_ingest_source(a.source, params)
    try:
        with early_prefect(a.store, a.verbose):
            from flows.ingest import check_rows, ingest

            if (nothing := check_rows(a.source, params, a.skip_invalid, a.source_name)) is not None:
                raise _NothingValid(nothing)  # inside the block: the Prefect home made for the flow is undone
    except _NothingValid as e:
        summary = e.args[0]
    else:
        summary = ingest(a.source, size=a.size, seed=a.seed, params=params, skip_invalid=a.skip_invalid,
                         source_name=a.source_name, store=a.store)
    from tasks.ingest import IngestSummary

    for line in summary["skipped"]:
        print(f"skipped {line}", file=sys.stderr)
    print(IngestSummary(**summary))
    return 0


def cmd_import(a: argparse.Namespace) -> int:
    from flows.config import RUN_ID

    if not re.fullmatch(RUN_ID, a.run_id):
        raise CliError(f"--run-id {a.run_id!r}: letters, digits, '_', '.' and '-', starting with a letter or digit")
    # the settings only: the dump, the tokenizer and the digest are checked before anything (a Prefect home
    # included) is made, so a refused import leaves the store as it was, or absent
    prepare_prefect(a.store, a.verbose, server=False, make_home=False)
    from storage.store import Store
    from tasks.interop.import_run import land_import, prepare_import

    prepared = prepare_import(a.format, a.path, correct_at=a.correct_at, tokenizer=a.tokenizer,
                              skip_invalid=a.skip_invalid, reward_column=a.reward_column)
    prepare_prefect(a.store, a.verbose, server=False)  # landing imports tasks.ingest, which imports Prefect
    summary = land_import(Store(a.store), prepared, a.run_id)
    for line in summary.skipped_rows:
        print(f"skipped {line}", file=sys.stderr)
    print(summary)
    return 0


def cmd_run(a: argparse.Namespace) -> int:
    config, curriculum = prepared_run(a)
    try:
        with stage_lines():
            out = curriculum(config)
    except Exception as e:
        if getattr(e, "hint", None) is None and _marked_failed(config.store, config.run_id):
            e.hint = (f"run {config.run_id} is marked failed (runs.reason says why); the same command with "
                      f"--run-id {config.run_id} resumes it at the first stage that has not landed")
        raise
    print_summary(out)
    return 0


@contextlib.contextmanager
def stage_lines():
    """Print the flow's line per finished stage (flows/curriculum.py `progress`) on stdout while the block runs:
    the progress of a run whose Prefect console log is off."""
    progress = logging.getLogger("refinery.progress")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level, propagate = progress.level, progress.propagate
    progress.addHandler(handler)
    progress.setLevel(logging.INFO)
    progress.propagate = False  # not again through the root logger's handlers
    try:
        yield
    finally:
        progress.removeHandler(handler)
        progress.setLevel(level)
        progress.propagate = propagate


def prepared_run(a: argparse.Namespace, early_server: bool = True):
    """`run`'s checked config and its flow, with Prefect's server up (started early: `early_prefect`)."""
    with early_prefect(a.store, a.verbose, early_server):
        from flows.config import load_config, placed, resumed_config
        from flows.preflight import validate_for_run

        stored = resumed_config(a.store, a.run_id)  # None for a new run
        config = load_config(a.config, a.set, stored=stored, run_id=a.run_id, rounds=a.rounds, store=a.store)
        # run id (named in the hint below) and store filled in first: the flow validates the very same config,
        # so its own check is free
        config = placed(config)
        if stored is not None:  # a resume: what the user gave differs from the stored run only where allowed
            from flows.resume import check_resume

            check_resume(config, stored)
        validate_for_run(config)  # sources, models, teacher, backend: before any flow starts
        from flows.curriculum import curriculum
    return config, curriculum


def _marked_failed(store_uri: str, run_id: str) -> bool:
    """Did the run end as `failed` (not refused before it started, nor locked by another process)?"""
    from storage.runs import run_rows
    from storage.store import Store

    try:
        rows = run_rows(Store(store_uri), run_id)
    except Exception:  # the store itself is the problem: the error line says so, and no hint is better
        return False
    return rows.height > 0 and rows["status"][-1] == "failed"


def cmd_eval(a: argparse.Namespace) -> int:
    with early_prefect(a.store, a.verbose):
        from flows.evaluate import eval_target, evaluate
        from storage.store import Store

        eval_target(Store(a.store), a.run_id, a.checkpoint, a.dataset, a.dataset_name)  # refused before the flow
    out = evaluate(run_id=a.run_id, checkpoint=a.checkpoint, store=a.store, dataset=a.dataset,
                   dataset_name=a.dataset_name)
    for e in out["evals"]:
        if e["split"] != out["split"]:
            continue
        print(f"run {out['run_id']} v{e['policy_version']} (round {e['round']}, {e['split']}, {e['n_prompts']} "
              f"prompts): pass@1 {e['pass_at_1']:.3f}, pass@{e['k']} {e['pass_at_k']:.3f}")
    return 0


def cmd_report(a: argparse.Namespace) -> int:
    # tasks.report imports Prefect, which needs only its settings here (a report runs no flow); its import makes
    # the home folder, removed again (while empty) when the report is refused: the store stays as it was
    from flows.server.prefect_home import missing_folders, prefect_home, remove_made

    home = prefect_home(a.store)
    made = missing_folders(home)
    prepare_prefect(a.store, a.verbose, server=False, make_home=False)
    from storage.store import Store
    from tasks.report import write_report

    try:
        print(write_report(Store(a.store), a.run_id, a.out) / "index.html")
    except BaseException:
        remove_made(made, home / "prefect.db", None)
        raise
    return 0


def cmd_compare(a: argparse.Namespace) -> int:
    extra: dict[str, list[str]] = {}
    for item in a.arm:
        name, sep, override = item.partition(":")
        if not sep or not name or "=" not in override:
            raise CliError(f"--arm {item!r}: expected NAME:section.key=value")
        extra.setdefault(name, []).append(override)
    with early_prefect(a.store, a.verbose):
        from flows.compare import prepare_comparison, run_comparison
        from tasks.compare.arms import ARMS

        extra = {name: [*ARMS.get(name, []), *overrides] for name, overrides in extra.items()}
        arms = [x.strip() for x in a.arms.split(",") if x.strip()]
        comparison = prepare_comparison(arms, a.seeds, a.prefix, list(a.set), extra, a.rounds, a.store, a.config,
                                        datasets=a.dataset, allow_mixed=a.allow_mixed)
    if comparison.mixed:
        print(f"compare: WARNING: {comparison.mixed}", flush=True)

    def started(r) -> None:
        print(f"compare: {r.run_id} (arm {r.arm}, seed {r.seed})", flush=True)

    with stage_lines():
        out = run_comparison(comparison, on_run=started)
    for run in out:
        res = run["result"]
        print(f"compare: {run['planned'].run_id} " + ("already complete" if res.get("skipped") else
                                                      f"done in {res['seconds']:.0f} s")
              + (f"; {res['stopped']}" if res.get("stopped") else ""))
    from flows.compare import matched_lines, summary_lines
    from storage.store import Store

    planned = [run["planned"] for run in out]
    warning = [f"WARNING: {comparison.mixed}"] if comparison.mixed else []
    for line in warning + summary_lines(Store(a.store), planned) + matched_lines(Store(a.store), a.prefix, planned):
        print(f"compare: {line}")
    return 0


def cmd_rescore(a: argparse.Namespace) -> int:
    with early_prefect(a.store, a.verbose):
        from flows.rescore import NothingToRescore, rescore, rescore_target
        from storage.store import Store

        with contextlib.suppress(NothingToRescore):  # a no-op, not an error: the flow reports it
            rescore_target(Store(a.store), a.run_id)  # refused before the flow
    out = rescore(run_id=a.run_id, store=a.store)
    if "skipped" in out:
        print(f"rescore: {out['skipped']}")
    else:
        buckets = ", ".join(f"{k} {v}" for k, v in sorted(out["buckets"].items())) or "none"
        print(f"run {out['run_id']} round {out['round']}: rescored {out['reserve']} reserve prompts with "
              f"v{out['policy_version']} ({buckets}); {out['reactivated']} come back as active next round")
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    from flows.server import serve

    if a.stop:
        state = serve.stop_running(serve.prefect_home(a.store))
        print(f"stopped refinery serve (pid {state['pid']}) at {state['url']}; port {state['port']} is closed")
        return 0
    prepare_prefect(a.store, a.verbose, console=True)  # the worker's flow-run logs are what serve shows
    if a.concurrency is not None and a.concurrency < 1:
        raise CliError(f"--concurrency {a.concurrency}: at least 1 run at a time")
    return serve.run(a.store, a.port, a.pool, concurrency=a.concurrency)
