"""`refinery`: the command-line contract users and scripts rely on (README.md, "The CLI").

Every command takes --store DIR|URI (default $REFINERY_STORE, else ./refinery-store). Exit code 0 on
success; otherwise non-zero with the reason on stderr. Prefect is imported lazily, after its home has been
pointed inside the store, so that it never scatters state into ~ and commands that need no flow start fast.

Errors: every failure prints one line, `refinery: error: <what, naming the input>`, plus at most one
`hint: ...` line, and exits 1 (2 for a bad command line); the traceback only with --debug or
REFINERY_DEBUG=1. What can be checked before Prefect starts is (the store, a run's whole config, an ingest
source's name and file), so a typo costs no server start. Prefect's console log is silenced unless -v is
given: its ERROR records carry the same traceback again (its API log handler still feeds the UI).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import sys
from pathlib import Path

from flows.prefect_home import prefect_home

READ_COMMANDS = ("sql", "lineage", "report", "eval", "catalog", "rescore")  # refused on a store that is not there


class CliError(ValueError):
    """A bad command-line input, found before any work; `hint` is printed on a second line."""

    user_facing = True

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


def _prepare_prefect(store_uri: str, verbose: bool, console: bool = False) -> None:
    """Keep Prefect's home and database in a folder the user can see, and its console logs quiet (unless
    `verbose`, or `console` for a command whose job is to show them)."""
    os.environ["PREFECT_HOME"] = str(prefect_home(store_uri))
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO" if verbose else "WARNING")
    if not (verbose or console):
        # Prefect logs a failing task or flow at ERROR with its whole traceback (and again per state change);
        # the CLI prints the reason as one line instead. The API handler still sends every record to the UI.
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")
    # A fresh ephemeral server migrates its SQLite database first; on a busy 2-core machine that has taken
    # over Prefect's default 20 s, and the run then died before doing anything.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    if not verbose:
        # The ephemeral Prefect server cancels its SQLite connections at interpreter exit, and SQLAlchemy logs
        # that as an ERROR with a traceback after a successful run; it is shutdown noise, not a failure.
        import logging

        logging.getLogger("sqlalchemy.pool").setLevel(logging.CRITICAL)


def _params(pairs: list[str]) -> dict[str, str]:
    out = {}
    for p in pairs:
        if "=" not in p:
            raise ValueError(f"--param {p!r}: expected key=value")
        k, v = p.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def _check_ingest_source(source: str, params: dict) -> None:
    """The source's name, and a file's existence, type and emptiness, before Prefect starts (the flow then
    validates every row)."""
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
    if path.suffix.lower() == ".jsonl" and not _has_text(path):
        raise CliError(f"{source}: no rows (the file is empty or holds only blank lines)")


def _has_text(path: Path, chunk: int = 1 << 16) -> bool:
    with path.open("rb") as f:
        while block := f.read(chunk):
            if block.strip():
                return True
    return False


def cmd_ingest(a: argparse.Namespace) -> int:
    _check_ingest_source(a.source, _params(a.param))
    _prepare_prefect(a.store, a.verbose)
    from flows.ingest import ingest

    summary = ingest(a.source, size=a.size, seed=a.seed, params=_params(a.param), skip_invalid=a.skip_invalid,
                     source_name=a.source_name, store=a.store)
    from tasks.ingest import IngestSummary

    for line in summary["skipped"]:
        print(f"skipped {line}", file=sys.stderr)
    print(IngestSummary(**summary))
    return 0


def cmd_run(a: argparse.Namespace) -> int:
    from flows.config import load_config, placed
    from flows.preflight import validate_for_run

    config = load_config(a.config, a.set, run_id=a.run_id, rounds=a.rounds, store=a.store)  # fails before any work
    # run id (named in the hint below) and store filled in first: the flow validates the very same config,
    # so its own check is free
    config = placed(config)
    validate_for_run(config)  # sources, models, teacher, backend: still before Prefect starts
    _prepare_prefect(a.store, a.verbose)
    from flows.curriculum import curriculum
    try:
        out = curriculum(config)
    except Exception as e:
        if getattr(e, "hint", None) is None and _marked_failed(config.store, config.run_id):
            e.hint = (f"run {config.run_id} is marked failed (runs.reason says why); the same command with "
                      f"--run-id {config.run_id} resumes it at the first stage that has not landed")
        raise
    print_summary(out)
    return 0


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
    _prepare_prefect(a.store, a.verbose)
    from flows.evaluate import evaluate

    out = evaluate(run_id=a.run_id, checkpoint=a.checkpoint, store=a.store)
    for e in out["evals"]:
        print(f"run {out['run_id']} v{e['policy_version']} (round {e['round']}, {e['split']}, {e['n_prompts']} "
              f"prompts): pass@1 {e['pass_at_1']:.3f}, pass@{e['k']} {e['pass_at_k']:.3f}")
    return 0


def cmd_report(a: argparse.Namespace) -> int:
    _prepare_prefect(a.store, a.verbose)  # tasks.report imports prefect
    from storage.store import Store
    from tasks.report import write_report

    print(write_report(Store(a.store), a.run_id, a.out) / "index.html")
    return 0


def _unavailable(stage: dict, what: str) -> str:
    """The tail of a stage's line when its teacher could not answer some prompts (they fell back)."""
    n = stage.get("teacher_unavailable") or 0
    return f"; teacher unavailable for {n} prompt{'s' * (n != 1)} ({what})" if n else ""


def _short_batch(dapo: dict) -> str:
    """The tail of a dapo_filter round's line when its batch came up short, and why."""
    if not dapo["short"]:
        return ""
    why = (f"the cap of {dapo['max_batches']} generation batch{'es' * (dapo['max_batches'] != 1)} was hit"
           if dapo["cap_hit"]
           else "every candidate was generated")
    return f"; the batch is SHORT by {dapo['short']} groups ({why})"


def print_summary(out: dict) -> None:
    from storage.query import sql
    from storage.store import Store
    from tasks.utility import ROUND_OWN_SCORES

    store, run = Store(out["store"]), out["run_id"]
    for s in out["stages"]:
        if "skipped" in s:
            continue
        if s["stage"] == "collect":
            print(f"round {s['round']}: {s['rollouts']} rollouts over {s['prompts']} prompts, pass rate "
                  f"{s['pass_rate']:.1%}, {s['tokens_per_s']:.0f} tokens/s")
            lope = s.get("lope") or {}
            if lope.get("groups"):
                print(f"round {s['round']}: LoPE resampled {lope['groups']} all-fail groups ({lope['resamples']} "
                      f"samples, {lope.get('seconds', 0):.0f} s), rescued {lope['rescued']}, replaced {lope['replaced']} rollouts")
            if s.get("verify_timeouts"):
                print(f"round {s['round']}: {s['verify_timeouts']} math-verify checks timed out and scored 0 "
                      f"(rollouts.verify_timeout)")
            if d := s.get("dapo"):
                print(f"round {s['round']}: dapo_filter kept {d['kept']} of B = {d['batch_size']} groups from "
                      f"{d['groups_generated']} generated in {d['generation_batches']} generation batch"
                      f"{'es' * (d['generation_batches'] != 1)}; discarded "
                      f"{d['zero_variance']} zero-variance + {d['surplus']} surplus groups ({d['discarded_rollouts']} "
                      f"rollouts, {d['discarded_tokens']} tokens; see discarded_rollouts)" + _short_batch(d))
        elif s["stage"] == "score":  # rescued groups apart: their replacements train, the buckets are the policy's
            rescued = dict(s.get("rescued") or {})
            n = rescued.pop("groups", 0)
            own = ", ".join(f"{k} {v}" for k, v in sorted(rescued.items()))
            print(f"round {s['round']}: {s['buckets'].get('informative', 0)} of {s['prompts']} groups informative; "
                  f"{n} rescued by LoPE (training only; scored on the policy's own samples" + (f": {own})" if n else ")"))
        elif s["stage"] == "select" and "clusters" in s:
            print(f"round {s['round']}: selected {s['selected']} of {s['candidates']} over {s['clusters']} clusters "
                  f"({s['selected_unscored']} never scored; scored ones: mean EPS {s['mean_eps_selected']:.3f} "
                  f"vs {s['mean_eps_pool']:.3f} over the candidates)")
        elif s["stage"] == "shape":
            print(f"round {s['round']}: shaped {s['in_c']} of {s['traces']} off-policy traces (acceptance "
                  f"{s['accept_rate'] if s['accept_rate'] is not None else '-'}, mean log-prob gain "
                  f"{s['logprob_gain'] if s['logprob_gain'] is not None else '-'})" + _unavailable(s, "skipped"))
        elif s["stage"] == "train":
            print(f"round {s['round']}: trained v{s['policy_version']} in {s['steps']} steps on {s['sequences']} "
                  f"sequences ({s['zero_variance_groups']} zero-variance groups skipped, {s['sft_traces']} SFT "
                  f"traces), loss {s['first_loss']} -> {s['last_loss']}, {s['tokens_per_s']:.0f} tokens/s")
        elif s["stage"] == "evaluate":
            for v, m in sorted(s["versions"].items()):
                print(f"round {s['round']}: held-out v{v}: " + ", ".join(f"{k} {x:.3f}" for k, x in m.items()))
        elif s["stage"] == "refine":
            detail = ", ".join(f"{k} {v}" for k, v in sorted(s["by_strategy"].items()))
            print(f"round {s['round']}: refine made {s['children']} children ({detail})"
                  + _unavailable(s, "fell back; see refinements.reason"))
            if s.get("rejections"):
                why = ", ".join(f"{k} {v}" for k, v in sorted(s["rejections"].items()))
                print(f"round {s['round']}: rejected {sum(s['rejections'].values())} children ({why}; "
                      f"see refinements.reason)")
    q = f"""SELECT round, bucket, count(*) AS prompts, round(avg(mean_reward), 3) AS mean_pass,
            round(quantile_cont(eps, 0.25), 3) AS eps_p25, round(median(eps), 3) AS eps_p50,
            round(quantile_cont(eps, 0.75), 3) AS eps_p75, round(max(eps), 3) AS eps_max
            FROM (SELECT * FROM prompt_scores WHERE run_id = '{run}' {ROUND_OWN_SCORES})
            GROUP BY ALL ORDER BY round, bucket"""
    print(_format(sql(store, q), "table"))
    reports = [s["path"] for s in out["stages"] if s.get("stage") == "report"]
    if reports:
        print(f"report: {reports[-1]} (redraw it with: refinery report {run})")
    how = "resumed" if out["started_as"] == "resumed" else "new run"
    print(f"run {run} ({how}) finished in {out['seconds']:.0f} s; store: {store.uri}")
    print(f"try: {try_command(store.uri, run)}")


def try_command(store_uri: str, run_id: str) -> str:
    """A `refinery sql` command line for the end of a run, quoted so that a shell gives it back as argv."""
    literal = "'" + run_id.replace("'", "''") + "'"  # an SQL string literal (run ids cannot hold quotes today)
    example = f"SELECT round, bucket, count(*) FROM prompt_scores WHERE run_id = {literal} GROUP BY ALL ORDER BY ALL"
    return shlex.join(["refinery", "sql", "--store", store_uri, example])


def _format(t, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(t.to_pylist(), default=str, ensure_ascii=False, indent=1)
    if fmt == "csv":
        import csv

        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(t.column_names)
        w.writerows(tuple(r.values()) for r in t.to_pylist())
        return buf.getvalue().rstrip("\n")
    import polars as pl

    with pl.Config(tbl_rows=-1, tbl_cols=-1, fmt_str_lengths=100, tbl_hide_dataframe_shape=True):
        return str(pl.from_arrow(t)) + f"\n({t.num_rows} rows)"


def cmd_rescore(a: argparse.Namespace) -> int:
    _prepare_prefect(a.store, a.verbose)
    from flows.rescore import rescore

    out = rescore(run_id=a.run_id, store=a.store)
    if "skipped" in out:
        print(f"rescore: {out['skipped']}")
    else:
        buckets = ", ".join(f"{k} {v}" for k, v in sorted(out["buckets"].items())) or "none"
        print(f"run {out['run_id']} round {out['round']}: rescored {out['reserve']} reserve prompts with "
              f"v{out['policy_version']} ({buckets}); {out['reactivated']} come back as active next round")
    return 0


def cmd_sql(a: argparse.Namespace) -> int:
    from storage.query import sql
    from storage.store import Store

    print(_format(sql(Store(a.store), a.query), a.format))
    return 0


def cmd_catalog(a: argparse.Namespace) -> int:
    from storage.query import write_catalog
    from storage.store import Store

    path = write_catalog(Store(a.store))
    # the catalog names its files relative to the store folder (so a copied store works): open it from there
    print(f"wrote {path}; open it with: cd {shlex.quote(os.path.dirname(path))} && duckdb -readonly catalog.duckdb")
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    from flows import serve

    if a.stop:
        state = serve.stop_running(serve.prefect_home(a.store))
        print(f"stopped refinery serve (pid {state['pid']}) at {state['url']}; port {state['port']} is closed")
        return 0
    _prepare_prefect(a.store, a.verbose, console=True)  # the worker's flow-run logs are what serve shows
    return serve.run(a.store, a.port, a.pool)


def cmd_lineage(a: argparse.Namespace) -> int:
    from storage.lineage import lineage
    from storage.query import connect
    from storage.store import Store

    con = connect(Store(a.store))
    tree = lineage(con, a.prompt_id)
    ids = [tree["prompt"]["prompt_id"], *(d["prompt_id"] for d in tree["descendants"])]
    history = con.sql("""
        SELECT s.prompt_id, s.run_id, s.round, round(s.mean_reward, 3) AS pass_rate, round(s.eps, 3) AS eps,
               s.bucket, p.status
        FROM prompt_scores s LEFT JOIN pool p USING (run_id, round, prompt_id)
        WHERE s.prompt_id IN (SELECT unnest($ids)) ORDER BY s.run_id, s.round""", params={"ids": ids}).to_arrow_table()
    status = con.sql("""SELECT prompt_id, arg_max(status, round) AS status FROM pool
                        WHERE prompt_id IN (SELECT unnest($ids)) GROUP BY 1""", params={"ids": ids}).to_arrow_table()
    rounds: dict[str, list[dict]] = {}
    for r in history.to_pylist():
        rounds.setdefault(r.pop("prompt_id"), []).append(r)
    latest = dict(zip(status["prompt_id"].to_pylist(), status["status"].to_pylist()))
    for node in [tree["prompt"], *tree["descendants"]]:
        node["rounds"] = rounds.get(node["prompt_id"], [])
        node["status"] = latest.get(node["prompt_id"])
    if a.json:
        print(json.dumps(tree, default=str, ensure_ascii=False, indent=1))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.tree import Tree

    def label(p: dict) -> str:
        scores = "  ".join(f"r{r['round']}: pass {r['pass_rate']:.2f} EPS {r['eps']:.2f} {r['bucket']}"
                           for r in p["rounds"])
        text = p["text"].splitlines()[0][:50]
        return (f"[bold]{p['prompt_id']}[/] [cyan]{p['transform']}[/] {escape('[' + (p['status'] or 'not in a pool') + ']')} "
                f"{escape(repr(text))}" + (f"\n  {scores}" if scores else ""))

    root = Tree(label(tree["prompt"]))
    nodes = {tree["prompt"]["prompt_id"]: root}
    for d in tree["descendants"]:
        nodes[d["prompt_id"]] = nodes.get(d["parent_id"], root).add(label(d))
    console = Console()
    if tree["ancestors"]:
        console.print("ancestors: " + " <- ".join(f"{p['prompt_id']} ({p['transform']})" for p in tree["ancestors"]))
    console.print(root)
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad command line reported like every other error: one line and a hint."""

    def error(self, message: str):
        self.exit(2, f"refinery: error: {message}\nhint: {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    from storage.store import default_root

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--store", default=default_root(), help="store root: a folder or an fsspec URI "
                        "(default: $REFINERY_STORE, else ./refinery-store)")
    common.add_argument("-v", "--verbose", action="store_true", help="show Prefect's INFO logs")
    # SUPPRESS: a subcommand's default must not overwrite `refinery --debug <command>`
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="on an error, print the traceback too (or set REFINERY_DEBUG=1)")

    p = _Parser(prog="refinery", description="Data refinement and curriculum for RL post-training.")
    p.add_argument("--debug", action="store_true", help="on an error, print the traceback too (or set "
                   "REFINERY_DEBUG=1)")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", parents=[common], help="the curriculum flow (default: the embedded model)")
    r.add_argument("--config", default=None, help="a TOML config file (see README)")
    r.add_argument("--run-id", default=None, help="rerunning an existing run id resumes it")
    r.add_argument("--rounds", type=int, default=None)
    r.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a field")
    r.set_defaults(func=cmd_run)

    i = sub.add_parser("ingest", parents=[common], help="validate and load prompts from a source")
    i.add_argument("source", help="rg:<reasoning-gym task> or a .jsonl/.parquet file")
    i.add_argument("--size", type=int, default=100, help="rg: number of prompts to generate")
    i.add_argument("--seed", type=int, default=0, help="rg: generator seed")
    i.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="rg: a difficulty field")
    i.add_argument("--skip-invalid", action="store_true", help="land the good rows and report the bad ones")
    i.add_argument("--source-name", default=None, help="files: the `source` to record (default: file name)")
    i.set_defaults(func=cmd_ingest)

    q = sub.add_parser("sql", parents=[common], help="read-only SQL over the store's views")
    q.add_argument("query")
    q.add_argument("--format", choices=["table", "csv", "json"], default="table")
    q.set_defaults(func=cmd_sql)

    c = sub.add_parser("catalog", parents=[common], help="write <store>/catalog.duckdb with the same views")
    c.set_defaults(func=cmd_catalog)

    sv = sub.add_parser("serve", parents=[common], help="a local Prefect server (UI), the process work pool, "
                        "a worker and prefect.yaml's deployments, until Ctrl-C")
    sv.add_argument("--port", type=int, default=4200, help="on 127.0.0.1 (default 4200)")
    sv.add_argument("--pool", default="refinery-process", help="the process work pool (prefect.yaml's is "
                    "refinery-process)")
    sv.add_argument("--stop", action="store_true", help="stop the `refinery serve` running on this store")
    sv.set_defaults(func=cmd_serve)

    e = sub.add_parser("eval", parents=[common], help="held-out pass@1 / pass@k of a run's checkpoint")
    e.add_argument("--run-id", default=None, help="default: the newest run")
    e.add_argument("--checkpoint", type=int, default=None, help="policy_version (default: the newest)")
    e.set_defaults(func=cmd_eval)

    rs = sub.add_parser("rescore", parents=[common], help="re-score a completed run's reserve pool with its "
                        "newest checkpoint (the nightly deployment)")
    rs.add_argument("--run-id", default=None, help="default: the newest run")
    rs.set_defaults(func=cmd_rescore)

    lg = sub.add_parser("lineage", parents=[common], help="a prompt's ancestors and descendants")
    lg.add_argument("prompt_id")
    lg.add_argument("--json", action="store_true")
    lg.set_defaults(func=cmd_lineage)

    rp = sub.add_parser("report", parents=[common], help="(re)draw a run's report: PNG plots and index.html")
    rp.add_argument("run_id")
    rp.add_argument("--out", default=None, metavar="DIR", help="the report folder (default: <store>/_reports/"
                    "run_id=<run>; for a remote store ./refinery-reports/<run>)")
    rp.set_defaults(func=cmd_report)
    return p


def check_store(command: str, uri: str) -> None:
    """Refuse a store root that is a file, and (for a read command) one that does not exist, before
    anything creates it: a read of a missing store would otherwise print zero rows and leave a new folder."""
    from storage.store import Store

    origin = " (from $REFINERY_STORE)" if os.environ.get("REFINERY_STORE") == uri else ""
    store = Store(uri)
    try:
        is_dir, exists = store.fs.isdir(store.root), store.fs.exists(store.root)
    except Exception as e:  # an unreachable remote store: say which, in one line
        from flows.errors import one_line

        raise CliError(f"store {uri}{origin} cannot be reached: {one_line(e)}") from None
    if exists and not is_dir:
        raise CliError(f"store {uri}{origin} is a file, not a folder",
                       hint="point --store or $REFINERY_STORE at a folder (a new one is created by ingest or run)")
    if command in READ_COMMANDS and not exists:
        raise CliError(f"store {uri}{origin} does not exist; nothing to read",
                       hint="create it with `refinery ingest` or `refinery run`, or point --store at an existing one")


def _debug(args: argparse.Namespace) -> bool:
    return getattr(args, "debug", False) or os.environ.get("REFINERY_DEBUG", "").strip() not in ("", "0")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if not (args.command == "serve" and args.stop):  # --stop looks for a server, not at the store
            check_store(args.command, args.store)
        return args.func(args)
    except KeyboardInterrupt:
        print("refinery: error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from flows.errors import is_user_facing, one_line

        if _debug(args):
            import traceback

            traceback.print_exc()
        print(f"refinery: error: {one_line(e)}", file=sys.stderr)
        hint = getattr(e, "hint", None)
        if hint is None and not is_user_facing(e) and not _debug(args):
            hint = "this looks like a bug: rerun with --debug (or REFINERY_DEBUG=1) for the traceback"
        if hint:
            print(f"hint: {hint}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
