"""Commit records: where a landed stage's record lies, what a valid one says, and reading them all.

A stage's commit record is `_landed/run_id=<run>/round=<round>/<stage>.json` (storage/store.py writes it as
the commit point: readers list data files from commit records only). Ingested prompts have no run: they land
under `run_id=_ingest/round=_`.

Records are validated on every read: a record that is not JSON, lacks a key, lies at a path that does not
match its content, names a file outside its own stage folder or a file that does not exist, and any stray
file under `_landed/`, is reported once per process by path in one log line and skipped. Every data path must
lie in the stage's own folder, so a forged record cannot point the views at other files of the store
(Prefect's database, a lock) or outside it. A stage whose record is invalid counts as not landed, for readers
and for resume alike, so a resumed run re-runs it and its commit replaces the record (and the stage folder).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable

from storage.schemas import TABLES

log = logging.getLogger("refinery.store")

NO_RUN = "_ingest"
NO_ROUND = "_"
# _landed/run_id=<run>/round=<round>/<stage>.json, and the in-flight temp name of an atomic write of one
RECORD = re.compile(r"^run_id=([^/]+)/round=([^/]+)/([^/]+)\.json$")
RECORD_IN_FLIGHT = re.compile(r"^run_id=[^/]+/round=[^/]+/[^/]+\.json\.[0-9a-f]{32}\.tmp$")
_reported: set[tuple[str, str]] = set()  # (path, problem) already logged by this process


def partition(run_id: str | None, round: int | None) -> tuple[str, str]:
    """The hive partition folders of (run_id, round): `run_id=<run>`, `round=<round>`."""
    return f"run_id={run_id if run_id is not None else NO_RUN}", f"round={NO_ROUND if round is None else round}"


def record_path(root: str, run_id: str | None, round: int | None, stage: str) -> str:
    """Where the commit record of (run_id, round, stage) lies under the store root `root`."""
    return "/".join([root, "_landed", *partition(run_id, round), f"{stage}.json"])


def report_skipped(path: str, problem: str) -> None:
    """Log a skipped `_landed/` file once per process, in one line that names it."""
    if (path, problem) not in _reported:
        _reported.add((path, problem))
        log.warning("skipping %s: %s", path, problem)


_ATTEMPT = re.compile(r"^attempt=[0-9a-f]{32}/")


def parse_record(root: str, path: str, text: str) -> tuple[dict, str | None]:
    """Check a commit record found at `path` against the layout; returns it and None, or ({}, the problem in a
    few words)."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        return {}, f"not valid JSON ({e})"
    if not isinstance(record, dict):
        return {}, f"not a JSON object but {type(record).__name__}"
    missing = [k for k in ("run_id", "round", "stage", "tables") if k not in record]
    if missing:
        return {}, "missing key(s) " + ", ".join(map(repr, missing))
    run_id, round, stage, tables = record["run_id"], record["round"], record["stage"], record["tables"]
    if not (run_id is None or isinstance(run_id, str)) or not (round is None or isinstance(round, int)) \
            or isinstance(round, bool) or not isinstance(stage, str) or not isinstance(tables, dict):
        return {}, "run_id, round, stage or tables has the wrong type"
    if path != record_path(root, run_id, round, stage):
        return {}, f"its content (run {run_id}, round {round}, stage {stage}) does not match its path"
    part = "/".join(partition(run_id, round))
    for table, entry in tables.items():
        if table not in TABLES:
            return {}, f"unknown table {table!r}"
        if not isinstance(entry, dict) or not isinstance(entry.get("paths"), list) \
                or not isinstance(entry.get("rows"), int):
            return {}, f"table {table!r} needs a list of 'paths' and a number of 'rows'"
        folder = f"{table}/{part}/stage={stage}/"
        for rel in entry["paths"]:
            name = rel[len(folder) :] if isinstance(rel, str) and rel.startswith(folder) else None
            if name and _ATTEMPT.match(name):  # an object store's commit: the parts sit in their attempt's folder
                name = name.split("/", 1)[1]
            if not name or "/" in name or name.startswith(".") or not name.endswith(".parquet"):
                return {}, f"table {table!r} names {rel!r}, which is not a part file of this stage"
    return record, None


def missing_files(record: dict, exists: Callable[[str], bool]) -> str | None:
    """The problem of a well-formed record that names data files (relative paths) that do not exist, or None."""
    missing = [p for t in record["tables"].values() for p in t["paths"] if not exists(p)]
    return f"names {len(missing)} data file(s) that do not exist, e.g. {missing[0]}" if missing else None


def read_record(fs, root: str, path: str) -> dict | None:
    """The valid commit record at `path` on the filesystem `fs`, or None: none there, or an invalid one, which
    is reported (`report_skipped`)."""
    try:
        with fs.open(path, "r") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        report_skipped(path, f"unreadable: {e}")
        return None
    record, problem = parse_record(root, path, text)
    if problem is None:
        problem = missing_files(record, lambda rel: fs.exists(f"{root}/{rel}"))
    if problem is not None:
        report_skipped(path, problem)
        return None
    return record


def scan_records(fs, root: str) -> tuple[list[dict], list[tuple[str, str]]]:
    """(valid commit records, [(path, problem)] for every other file under `_landed/`) of the store at `root`
    on the filesystem `fs`; the problems are reported too."""
    top = f"{root}/_landed"
    good, bad = [], []
    try:
        found = sorted(fs.find(top))
    except FileNotFoundError:
        found = []
    existing: dict[str, set[str]] = {}  # table -> its data files, listed once per call

    def exists(rel: str) -> bool:
        table = rel.split("/", 1)[0]
        if table not in existing:
            stages = "/".join([root, table, "run_id=*", "round=*", "stage=*"])
            existing[table] = set(fs.glob(f"{stages}/*")) | set(fs.glob(f"{stages}/attempt=*/*"))
        return f"{root}/{rel}" in existing[table]

    for p in found:
        rel = p[len(top) + 1 :] if p.startswith(top + "/") else p
        if RECORD_IN_FLIGHT.match(rel):
            continue  # a record being written right now (write-then-rename), or debris of one
        if not RECORD.match(rel):
            bad.append((p, "not a commit record (a stray file), ignored"))
            continue
        try:
            with fs.open(p, "r") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            bad.append((p, f"unreadable: {e}"))
            continue
        record, problem = parse_record(root, p, text)
        if problem is None:
            problem = missing_files(record, exists)
        if problem is None:
            good.append(record)
        else:
            bad.append((p, problem))
    for p, problem in bad:
        report_skipped(p, problem)
    return good, bad
