"""`refinery`: the command-line contract users and scripts rely on (README.md, "The CLI").

Every command takes --store DIR|URI (default $REFINERY_STORE, else ./refinery-store). Exit code 0 on
success; otherwise non-zero with the reason on stderr. This module holds the argument parser, the store check
every command gets first, and the error handling; the commands themselves are in flows/cli/commands.py (those that
start work through Prefect, which is imported lazily, after its home has been pointed inside the store) and
flows/cli/read_commands.py (sql, catalog, lineage); flows/cli/run_summary.py prints the end of a run.

Errors: every failure prints one line, `refinery: error: <what, naming the input>`, plus at most one
`hint: ...` line, and exits 1 (2 for a bad command line); the traceback only with --debug or
REFINERY_DEBUG=1. What can be checked before a flow starts is (the store, a run's or a comparison's whole
config, an ingest source's name and file, the run of an eval or a rescore, an eval's checkpoint); the
commands that run flows start Prefect's server meanwhile and kill it on such an error
(flows/server/prefect_setup.py), the others start none. Prefect's console log is silenced unless -v is given: its
ERROR records carry the same traceback again (its API log handler still feeds the UI).
"""

from __future__ import annotations

import argparse
import errno
import os
import stat
import sys

from flows.cli.commands import (
    CliError,
    cmd_compare,
    cmd_eval,
    cmd_import,
    cmd_ingest,
    cmd_report,
    cmd_rescore,
    cmd_run,
    cmd_serve,
)
from flows.cli.read_commands import cmd_catalog, cmd_export, cmd_lineage, cmd_sql
from flows.cli.run_summary import print_summary, try_command
from tasks.compare.arms import ARMS

__all__ = ["CliError", "build_parser", "check_store", "main", "print_summary", "try_command"]

# refused on a store that does not exist or has no _landed/; the others may make one (not in memory://)
READ_COMMANDS = ("sql", "lineage", "report", "eval", "catalog", "rescore", "export")


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
    r.add_argument("--config", default=None, help="a TOML config file (docs/config.md)")
    r.add_argument("--run-id", default=None, help="rerunning an existing run id resumes it")
    r.add_argument("--rounds", type=int, default=None)
    r.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a field")
    r.set_defaults(func=cmd_run)

    cp = sub.add_parser("compare", parents=[common], help="arms side by side: one run per (arm, seed) on the "
                        "same pool and held-out split, paired seeds (flows/compare.py)")
    cp.add_argument("--arms", default="uniform,dapo_filter,eps_kmeans,refinery",
                    help=f"comma-separated arm names (built in: {', '.join(ARMS)})")
    cp.add_argument("--seeds", type=int, default=3, help="paired seeds 0..N-1 per arm (default 3)")
    cp.add_argument("--prefix", default="cmp", help="run ids are <prefix>-<arm>-s<seed> (default cmp)")
    cp.add_argument("--rounds", type=int, default=None)
    cp.add_argument("--config", default=None, help="a TOML config file shared by every arm")
    cp.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="an override shared by every arm (e.g. max_generated_tokens=200000)")
    cp.add_argument("--arm", action="append", default=[], metavar="NAME:SECTION.KEY=VALUE",
                    help="define or extend arm NAME with one override (repeat for more)")
    cp.add_argument("--dataset", action="append", default=[], metavar="FILE",
                    help="an external prompt file (.jsonl/.parquet, the ingest schema) that scores every run's "
                    "last checkpoint (and the base model once); repeat for more")
    cp.add_argument("--allow-mixed", action="store_true", help="compare runs made by different commits or by "
                    "code with uncommitted changes (refused otherwise; the summary then says so first)")
    cp.set_defaults(func=cmd_compare)

    i = sub.add_parser("ingest", parents=[common], help="validate and load prompts from a source")
    i.add_argument("source", help="rg:<reasoning-gym task> or a .jsonl/.parquet file")
    i.add_argument("--size", type=int, default=100, help="rg: number of prompts to generate")
    i.add_argument("--seed", type=int, default=0, help="rg: generator seed")
    i.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="rg: a difficulty field")
    i.add_argument("--skip-invalid", action="store_true", help="land the good rows and report the bad ones")
    i.add_argument("--source-name", default=None, help="files: the `source` to record (default: file name)")
    i.set_defaults(func=cmd_ingest)

    im = sub.add_parser("import", parents=[common], help="import another trainer's rollout dump as a run "
                        "(EPS, buckets, lineage, report, SQL)")
    im.add_argument("format", choices=["verl", "trl", "prime-rl", "plain"])
    im.add_argument("path", help="verl: rollout_data_dir or one {step}.jsonl; trl: the completions/ folder or one "
                    "parquet; prime-rl: the run's output folder or one traces.jsonl; plain: a .jsonl/.parquet")
    im.add_argument("--run-id", required=True, help="the run the dump becomes")
    im.add_argument("--correct-at", type=float, default=1.0, help="a reward at least this counts as correct")
    im.add_argument("--tokenizer", default="default", help="counts completion tokens where the dump does not "
                    "(a model spec; default: the embedded policy's)")
    im.add_argument("--reward-column", default=None, help="trl: the reward column (default: the sum of all)")
    im.add_argument("--skip-invalid", action="store_true", help="land the good rows and report the bad ones")
    im.set_defaults(func=cmd_import)

    ex = sub.add_parser("export", parents=[common], help="write a run's curriculum (or its shaped traces) as a "
                        "Parquet dataset for TRL, verl or SFT, or its held-out split as lm-eval tasks; with a "
                        "Hugging Face dataset card")
    ex.add_argument("run_id")
    ex.add_argument("out", help="a .parquet file (its card goes to <stem>.md beside it), or a folder in the "
                    "dataset-repo layout (data/ and README.md); outside the store")
    ex.add_argument("--format", choices=["trl", "verl", "sft", "lm-eval"], default="trl", help="trl: prompt "
                    "messages and our columns; verl: plus data_source, ability, reward_model, extra_info; sft: "
                    "shaped traces as messages; lm-eval: the held-out split (and eval --dataset sets) as "
                    "lm-evaluation-harness tasks in a folder (docs/interop.md)")
    ex.add_argument("--heldout", action="store_true", help="export the held-out split (with --format lm-eval "
                    "only: it is never exported as training data)")
    ex.add_argument("--round", type=int, default=None, help="the round whose pool and selection to export "
                    "(default: the run's last); sft: traces of rounds up to it")
    ex.add_argument("--license", default="other", help="the dataset card's license id (default: other; set it "
                    "to the terms of the prompt sources the run ingested)")
    ex.add_argument("--overwrite", action="store_true", help="replace OUT (and its card) if it exists; a "
                    "folder only when an earlier export wrote it")
    ex.set_defaults(func=cmd_export)

    q = sub.add_parser("sql", parents=[common], help="read-only SQL over the store's views")
    q.add_argument("query")
    q.add_argument("--format", choices=["table", "csv", "json"], default="table", help="table (at most --limit "
                   "rows), csv or json (every row; JSON's NaN is null)")
    q.add_argument("--limit", type=int, default=None, metavar="N", help="print at most N rows (default: 1000 for "
                   "the table, all for csv and json; 0: all)")
    q.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS", help="stop a query that runs longer "
                   "(default 60; 0: no limit)")
    q.set_defaults(func=cmd_sql)

    c = sub.add_parser("catalog", parents=[common], help="write <store>/catalog.duckdb with the same views")
    c.set_defaults(func=cmd_catalog)

    sv = sub.add_parser("serve", parents=[common], help="a local Prefect server (UI), the process work pool, "
                        "a worker and prefect.yaml's deployments, until Ctrl-C")
    sv.add_argument("--port", type=int, default=4200, help="on 127.0.0.1 (default 4200)")
    sv.add_argument("--pool", default="refinery-process", help="the process work pool (prefect.yaml's is "
                    "refinery-process)")
    sv.add_argument("--concurrency", type=int, default=None, help="runs the work pool runs at once when serve "
                    "creates it (default: one per 2 cores and 6 GiB of memory, at least one; more queue)")
    sv.add_argument("--stop", action="store_true", help="stop the `refinery serve` running on this store")
    sv.set_defaults(func=cmd_serve)

    e = sub.add_parser("eval", parents=[common], help="held-out pass@1 / pass@k of a run's checkpoint")
    e.add_argument("--run-id", default=None, help="default: the newest run")
    e.add_argument("--checkpoint", type=int, default=None, help="policy_version (default: the newest)")
    e.add_argument("--dataset", default=None, metavar="FILE", help="evaluate on this .jsonl/.parquet prompt file "
                   "(the ingest schema) instead of the run's held-out split; results land as split dataset:<name>")
    e.add_argument("--dataset-name", default=None, help="the dataset's name (default: the file's stem)")
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
    """Refuse a store argument that cannot be one, before anything creates it: empty, `memory://` (gone when
    the command ends), a path that is a file, a FIFO, a device or a symbolic link loop; and for a read command
    one that does not exist or holds no Refinery data (no `_landed/`): a read would otherwise print zero rows
    and leave a new folder."""
    from storage.store import Store

    origin = " (from $REFINERY_STORE)" if os.environ.get("REFINERY_STORE") == uri else ""
    if not uri.strip():
        raise CliError("--store is empty", hint="name a folder or an fsspec URI (default: $REFINERY_STORE, else "
                       "./refinery-store)")
    if uri.startswith("memory://"):
        raise CliError(f"store {uri}{origin}: a memory:// store lives only as long as this command, so what it "
                       "lands is gone when it ends", hint="use a folder or an object store URI (s3://...)")
    if "://" not in uri or uri.startswith("file://"):
        _check_local_kind(uri.removeprefix("file://"), f"store {uri}{origin}")
    store = Store(uri)
    try:
        is_dir, exists = store.fs.isdir(store.root), store.fs.exists(store.root)
        holds_data = command in READ_COMMANDS and is_dir and store.fs.exists(store.path("_landed"))
    except Exception as e:  # an unreachable remote store: say which, in one line
        from flows.cli.errors import one_line

        raise CliError(f"store {uri}{origin} cannot be reached: {one_line(e)}") from None
    if exists and not is_dir:
        raise CliError(f"store {uri}{origin} is a file, not a folder",
                       hint="point --store or $REFINERY_STORE at a folder (a new one is created by ingest or run)")
    if command in READ_COMMANDS and not exists:
        raise CliError(f"store {uri}{origin} does not exist; nothing to read",
                       hint="create it with `refinery ingest` or `refinery run`, or point --store at an existing one")
    if command in READ_COMMANDS and not holds_data:
        raise CliError(f"store {uri}{origin} is not a Refinery store: it has no _landed/ folder, so nothing to read",
                       hint="point --store at a store, or land data in this one with `refinery ingest` or `refinery run`")


def _check_local_kind(path: str, what: str) -> None:
    """A local store path that exists as something other than a folder or a file, or loops, named as such."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CliError(f"{what} is a symbolic link loop", hint="point --store at a folder") from None
        if e.errno == errno.ENOTDIR:
            raise CliError(f"{what} cannot be a folder: a folder on its path is a file",
                           hint="point --store at a folder") from None
        raise CliError(f"{what} cannot be read: {e.strerror}") from None
    kinds = {stat.S_ISFIFO: "a FIFO (named pipe)", stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device",
             stat.S_ISSOCK: "a socket"}
    for test, kind in kinds.items():
        if test(mode):
            raise CliError(f"{what} is {kind}, not a folder", hint="point --store or $REFINERY_STORE at a folder "
                           "(a new one is created by ingest or run)")


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
    except BrokenPipeError:  # the reader went away (`refinery sql ... | head`): what it wanted, it has
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error as Python flushes stdout
        return 0
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # an Exception, or a Rust panic from a library (pyo3's PanicException is not one)
        from flows.cli.errors import is_user_facing, one_line

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
