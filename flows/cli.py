"""`refinery`: the command-line contract of DESIGN.md.

Every command takes --store DIR|URI (default $REFINERY_STORE, else ./refinery-store). Exit code 0 on
success; otherwise non-zero with the reason on stderr. Prefect is imported lazily, after its home has been
pointed inside the store, so that it never scatters state into ~ and commands that need no flow start fast.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from pathlib import Path


def prefect_home(store: str) -> Path:
    """$PREFECT_HOME, else <store>/.prefect for a local store (./.prefect for a remote one)."""
    if os.environ.get("PREFECT_HOME"):
        return Path(os.environ["PREFECT_HOME"]).expanduser().resolve()
    local = "://" not in store or store.startswith("file://")
    return ((Path(store.removeprefix("file://")) if local else Path.cwd()) / ".prefect").resolve()


def _prepare_prefect(store_uri: str, verbose: bool) -> None:
    """Keep Prefect's home and database in a folder the user can see, and its console logs quiet."""
    os.environ["PREFECT_HOME"] = str(prefect_home(store_uri))
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO" if verbose else "WARNING")
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


def cmd_ingest(a: argparse.Namespace) -> int:
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
    from flows.config import load_config

    config = load_config(a.config, a.set, run_id=a.run_id, rounds=a.rounds, store=a.store)  # fails before any work
    _prepare_prefect(a.store, a.verbose)
    from flows.curriculum import curriculum

    out = curriculum(config)
    print_summary(out)
    return 0


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
        elif s["stage"] == "select" and "clusters" in s:
            print(f"round {s['round']}: selected {s['selected']} of {s['candidates']} over {s['clusters']} clusters "
                  f"({s['selected_unscored']} never scored; scored ones: mean EPS {s['mean_eps_selected']:.3f} "
                  f"vs {s['mean_eps_pool']:.3f} over the candidates)")
        elif s["stage"] == "shape":
            print(f"round {s['round']}: shaped {s['in_c']} of {s['traces']} off-policy traces (acceptance "
                  f"{s['accept_rate'] if s['accept_rate'] is not None else '-'}, mean log-prob gain "
                  f"{s['logprob_gain'] if s['logprob_gain'] is not None else '-'})")
        elif s["stage"] == "train":
            print(f"round {s['round']}: trained v{s['policy_version']} in {s['steps']} steps on {s['sequences']} "
                  f"sequences ({s['zero_variance_groups']} zero-variance groups skipped, {s['sft_traces']} SFT "
                  f"traces), loss {s['first_loss']} -> {s['last_loss']}, {s['tokens_per_s']:.0f} tokens/s")
        elif s["stage"] == "evaluate":
            for v, m in sorted(s["versions"].items()):
                print(f"round {s['round']}: held-out v{v}: " + ", ".join(f"{k} {x:.3f}" for k, x in m.items()))
        elif s["stage"] == "refine":
            detail = ", ".join(f"{k} {v}" for k, v in sorted(s["by_strategy"].items()))
            print(f"round {s['round']}: refine made {s['children']} children ({detail})")
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
    example = f"SELECT round, bucket, count(*) FROM prompt_scores WHERE run_id = '{run}' GROUP BY ALL ORDER BY ALL"
    print(f'try: refinery sql --store {store.uri} "{example}"')


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
    print(f"wrote {path}; open it with: duckdb -readonly {path}")
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    from flows import serve

    try:
        if a.stop:
            state = serve.stop_running(serve.prefect_home(a.store))
            print(f"stopped refinery serve (pid {state['pid']}) at {state['url']}; port {state['port']} is closed")
            return 0
        _prepare_prefect(a.store, a.verbose)
        return serve.run(a.store, a.port, a.pool)
    except serve.ServeError as e:
        print(f"refinery serve: {e}", file=sys.stderr)
        return 1


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


def build_parser() -> argparse.ArgumentParser:
    from storage.store import default_root

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--store", default=default_root(), help="store root: a folder or an fsspec URI "
                        "(default: $REFINERY_STORE, else ./refinery-store)")
    common.add_argument("-v", "--verbose", action="store_true", help="show Prefect's INFO logs")

    p = argparse.ArgumentParser(prog="refinery", description="Data refinement and curriculum for RL post-training.")
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("refinery: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if not isinstance(e, (ValueError, KeyError, FileNotFoundError, PermissionError)) and \
                not getattr(e, "user_facing", False):
            raise
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"refinery {args.command}: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
