"""The experience store: Parquet tables under one root, committed one stage at a time.

Layout (root is a local path or any fsspec URI):

    <table>/run_id=<run>/round=<round>/stage=<stage>/part-<i>.parquet data, one folder per table, hive style
    _landed/run_id=<run>/round=<round>/<stage>.json                   the commit record of a landed stage
    .tmp/<uuid>/                                                       a stage being written
    .locks/                                                            file locks (local roots)

A stage may write several tables. It writes all of them into a hidden `.tmp/<uuid>` folder, renames each
table's stage folder into place, and then writes its commit record (itself write-then-rename). The commit
record is the commit point: readers list data files from commit records only, so a stage whose record is
missing is invisible however far its renames got. Ingested prompts have no run: they land under
`run_id=_ingest/round=_`.

Commit records are validated on every read: a record that is not JSON, lacks a key, lies at a path that does
not match its content, names a file outside its own stage folder or a file that does not exist, and any
stray file under `_landed/`, is reported once per process by path in one log line and skipped. A stage whose
record is invalid counts as not landed, for readers and for resume alike, so a resumed run re-runs it and its
commit replaces the record (and the stage folder); until then `cleanup` keeps that folder, which may be all
that is left of an ingest.

Temp folders are claimed atomically: a writer creates `.tmp/<uuid>` and its `owner.json` under the commit
lock, which `cleanup` holds for its whole scan, so cleanup never sees a folder without its owner. On a remote
root the owner record is the folder's first object (object stores have no empty folders). Cleanup removes a
folder whose owner is this host and a dead pid, or whose owner record is missing (debris of a crash), and a
folder of another host only when it is older than `FOREIGN_TMP_TTL_S` (it cannot tell whether that host's
writer is alive).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from filelock import FileLock
from fsspec.implementations.local import LocalFileSystem

from storage.schemas import TABLES, conform, schema

log = logging.getLogger("refinery.store")

DEFAULT_ROOT = "./refinery-store"
NO_RUN = "_ingest"
NO_ROUND = "_"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
# _landed/run_id=<run>/round=<round>/<stage>.json, and the in-flight temp name of an atomic write of one
_RECORD = re.compile(r"^run_id=([^/]+)/round=([^/]+)/([^/]+)\.json$")
_RECORD_IN_FLIGHT = re.compile(r"^run_id=[^/]+/round=[^/]+/[^/]+\.json\.[0-9a-f]{32}\.tmp$")
FOREIGN_TMP_TTL_S = 24 * 3600  # another host's temp folder is removed only when its owner record is this old
_reported: set[tuple[str, str]] = set()  # (path, problem) already logged by this process


def default_root() -> str:
    return os.environ.get("REFINERY_STORE") or DEFAULT_ROOT


def fault_point(name: str) -> None:
    """Test hook: when REFINERY_FAULT names this point, announce it and hang so a test can SIGKILL us here.
    With REFINERY_FAULT_RELEASE set, hang only until that file exists, then go on (for race tests)."""
    if os.environ.get("REFINERY_FAULT") != name:
        return
    flag = os.environ.get("REFINERY_FAULT_FLAG")
    if flag:
        Path(flag).write_text(str(os.getpid()))
    release = os.environ.get("REFINERY_FAULT_RELEASE")
    deadline = time.monotonic() + 3600
    while time.monotonic() < deadline and not (release and os.path.exists(release)):
        time.sleep(0.02)


def check_name(kind: str, value: str) -> str:
    if not _NAME.match(value):
        raise ValueError(f"{kind} {value!r} is not valid: use 1-128 letters, digits, '_', '.', '-'")
    return value


@dataclass(frozen=True)
class Commit:
    """What one call to `Store.commit` did."""

    run_id: str | None
    round: int | None
    stage: str
    landed_now: bool
    rows: dict[str, int] = field(default_factory=dict)

    @property
    def message(self) -> str:
        where = f"run {self.run_id} round {self.round} stage {self.stage}" if self.run_id else self.stage
        if not self.landed_now:
            return f"{where}: already landed, nothing written"
        return f"{where}: landed " + ", ".join(f"{n} {t}" for t, n in self.rows.items())


class Store:
    def __init__(self, root: str | os.PathLike | None = None):
        root = str(root if root is not None else default_root())
        self.uri = root
        self.fs, path = fsspec.core.url_to_fs(root)
        self.local = isinstance(self.fs, LocalFileSystem)
        self.root = os.path.abspath(path) if self.local else path.rstrip("/")

    def __repr__(self) -> str:
        return f"Store({self.uri!r})"

    # ---- paths ---------------------------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    @staticmethod
    def _partition(run_id: str | None, round: int | None) -> tuple[str, str]:
        return f"run_id={run_id if run_id is not None else NO_RUN}", f"round={NO_ROUND if round is None else round}"

    def _record_path(self, run_id: str | None, round: int | None, stage: str) -> str:
        return self.path("_landed", *self._partition(run_id, round), f"{stage}.json")

    # ---- locks ---------------------------------------------------------------------------------------------
    @contextmanager
    def lock(self, name: str, timeout: float = 600.0) -> Iterator[None]:
        """An inter-process lock. Local roots keep it in <root>/.locks; remote roots in a local cache folder,
        which serialises writers on this machine only (use one writer host per remote store)."""
        if self.local:
            folder = Path(self.root, ".locks")
        else:
            import hashlib

            digest = hashlib.sha256(self.uri.encode()).hexdigest()[:16]
            folder = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "refinery", "locks", digest)
        folder.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder / f"{name}.lock"), timeout=timeout):
            yield

    # ---- commit --------------------------------------------------------------------------------------------
    def landed(self, run_id: str | None, round: int | None, stage: str) -> bool:
        """Has this stage of this run and round been committed? Resume logic asks this. A record that is
        invalid (see `records`) is reported and counts as not landed: the stage runs again and replaces it."""
        path = self._record_path(run_id, round, stage)
        try:
            with self.fs.open(path, "r") as f:
                text = f.read()
        except FileNotFoundError:
            return False
        except (OSError, UnicodeDecodeError) as e:
            _report(path, f"unreadable: {e}")
            return False
        record, problem = self._parse_record(path, text)
        if problem is None:
            missing = [p for t in record["tables"].values() for p in t["paths"] if not self.fs.exists(self.path(p))]
            if missing:
                problem = f"names {len(missing)} data file(s) that do not exist, e.g. {missing[0]}"
        if problem is not None:
            _report(path, problem)
            return False
        return True

    def commit(
        self,
        stage: str,
        tables: Mapping[str, pa.Table],
        run_id: str | None = None,
        round: int | None = None,
    ) -> Commit:
        """Land `tables` as one stage of (run_id, round), atomically. Re-committing a landed stage is a no-op."""
        check_name("stage", stage)
        if run_id is not None:
            check_name("run_id", run_id)
        if self.landed(run_id, round, stage):
            result = Commit(run_id, round, stage, landed_now=False)
            log.info(result.message)
            return result
        conformed = {name: conform(name, t) for name, t in tables.items()}
        part = self._partition(run_id, round)
        stage_dir = f"stage={stage}"

        tmp = self._claim_tmp()
        jobs = []
        for name, t in conformed.items():
            folder = "/".join([tmp, name, *part, stage_dir])
            self.fs.makedirs(folder, exist_ok=True)
            jobs += [(f"{folder}/part-{i}.parquet", chunk) for i, chunk in enumerate(_split(t))]
        with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
            list(pool.map(lambda job: self._write_parquet(*job), jobs))  # pyarrow releases the GIL
        fault_point("commit:written")

        with self.lock("commit"):
            if self.landed(run_id, round, stage):  # a concurrent writer landed it while we wrote
                self.fs.rm(tmp, recursive=True)
                return Commit(run_id, round, stage, landed_now=False)
            files = {}
            for name, t in conformed.items():
                dest = "/".join([self.root, name, *part, stage_dir])
                if self.fs.exists(dest):  # debris of a crash between renames: never landed, safe to replace
                    self.fs.rm(dest, recursive=True)
                self.fs.makedirs(dest.rsplit("/", 1)[0], exist_ok=True)
                self._rename("/".join([tmp, name, *part, stage_dir]), dest)
                rel = "/".join([name, *part, stage_dir])
                n_parts = len(_split(t))
                files[name] = {"paths": [f"{rel}/part-{i}.parquet" for i in range(n_parts)], "rows": t.num_rows}
                fault_point("commit:renamed")
            record = {
                "run_id": run_id,
                "round": round,
                "stage": stage,
                "tables": files,
                "committed_at": datetime.now(UTC).isoformat(),
            }
            self._write_atomic(self._record_path(run_id, round, stage), json.dumps(record, indent=1))
            self.fs.rm(tmp, recursive=True)
        result = Commit(run_id, round, stage, landed_now=True, rows={n: t.num_rows for n, t in conformed.items()})
        log.info(result.message)
        return result

    def _claim_tmp(self) -> str:
        """Create a fresh `.tmp/<uuid>` holding its owner record, as one step for `cleanup`: under the commit
        lock (which cleanup holds while it scans), and on remote roots by writing the owner record as the
        folder's first object, so no cleanup on any host sees the folder without its owner."""
        tmp = self.path(".tmp", uuid.uuid4().hex)
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "created": time.time()}
        with self.lock("commit"):
            if self.local:
                self.fs.makedirs(tmp, exist_ok=True)
            fault_point("commit:tmp-created")
            try:
                self._write_text(f"{tmp}/owner.json", json.dumps(owner))
            except FileNotFoundError:  # a remote filesystem with real folders (sftp, ...): make it first
                self.fs.makedirs(tmp, exist_ok=True)
                self._write_text(f"{tmp}/owner.json", json.dumps(owner))
        return tmp

    def _write_parquet(self, path: str, t: pa.Table) -> None:
        # local roots write through pyarrow's native filesystem: fsspec's Python file wrapper is much slower
        pq.write_table(t, path, filesystem=None if self.local else self.fs, compression="zstd")

    def _rename(self, src: str, dst: str) -> None:
        if self.local:
            os.rename(src, dst)  # atomic on one filesystem
        else:
            self.fs.mv(src, dst, recursive=True)

    def _write_text(self, path: str, text: str) -> None:
        with self.fs.open(path, "w") as f:
            f.write(text)

    def _write_atomic(self, path: str, text: str) -> None:
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        self._write_text(tmp, text)
        self._rename(tmp, path)

    # ---- reading -------------------------------------------------------------------------------------------
    def records(self) -> list[dict]:
        """Every landed stage's valid commit record. Invalid ones and stray files are reported and skipped."""
        return self.scan_records()[0]

    def problems(self) -> list[str]:
        """One line per file under `_landed/` that readers skip, naming its path and what is wrong with it."""
        return [f"{p}: {problem}" for p, problem in self.scan_records()[1]]

    def scan_records(self) -> tuple[list[dict], list[tuple[str, str]]]:
        """(valid commit records, [(path, problem)] for every other file under `_landed/`)."""
        top = self.path("_landed")
        good, bad = [], []
        try:
            found = sorted(self.fs.find(top))
        except FileNotFoundError:
            found = []
        existing: dict[str, set[str]] = {}  # table -> its data files, listed once per call

        def exists(rel: str) -> bool:
            table = rel.split("/", 1)[0]
            if table not in existing:
                existing[table] = set(self.fs.glob(self.path(table, "run_id=*", "round=*", "stage=*", "*")))
            return self.path(rel) in existing[table]

        for p in found:
            rel = p[len(top) + 1 :] if p.startswith(top + "/") else p
            if _RECORD_IN_FLIGHT.match(rel):
                continue  # a record being written right now (write-then-rename), or debris of one
            if not _RECORD.match(rel):
                bad.append((p, "not a commit record (a stray file), ignored"))
                continue
            try:
                with self.fs.open(p, "r") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as e:
                bad.append((p, f"unreadable: {e}"))
                continue
            record, problem = self._parse_record(p, text)
            if problem is None:
                missing = [rp for t in record["tables"].values() for rp in t["paths"] if not exists(rp)]
                if missing:
                    problem = f"names {len(missing)} data file(s) that do not exist, e.g. {missing[0]}"
            if problem is None:
                good.append(record)
            else:
                bad.append((p, problem))
        for p, problem in bad:
            _report(p, problem)
        return good, bad

    def _parse_record(self, path: str, text: str) -> tuple[dict, str | None]:
        """Check a commit record against the layout; returns it and None, or ({}, the problem in a few words).

        Every data path must lie in the stage's own folder, so a forged record cannot point the views at
        other files of the store (Prefect's database, a lock) or outside it."""
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
        if path != self._record_path(run_id, round, stage):
            return {}, f"its content (run {run_id}, round {round}, stage {stage}) does not match its path"
        part = "/".join(self._partition(run_id, round))
        for table, entry in tables.items():
            if table not in TABLES:
                return {}, f"unknown table {table!r}"
            if not isinstance(entry, dict) or not isinstance(entry.get("paths"), list) \
                    or not isinstance(entry.get("rows"), int):
                return {}, f"table {table!r} needs a list of 'paths' and a number of 'rows'"
            folder = f"{table}/{part}/stage={stage}/"
            for rel in entry["paths"]:
                name = rel[len(folder) :] if isinstance(rel, str) and rel.startswith(folder) else None
                if not name or "/" in name or name.startswith(".") or not name.endswith(".parquet"):
                    return {}, f"table {table!r} names {rel!r}, which is not a part file of this stage"
        return record, None

    def files(self, table: str, records: list[dict] | None = None) -> list[str]:
        """The data files of `table` that belong to landed stages (full paths or URIs)."""
        schema(table)  # an unknown table is refused there, naming the store's tables
        recs = self.records() if records is None else records
        rels = sorted(p for r in recs if table in r["tables"] for p in r["tables"][table]["paths"])
        return [self.full(rel) for rel in rels]

    def full(self, rel: str) -> str:
        if self.local:
            return self.path(rel)
        return self.fs.unstrip_protocol(self.path(rel))

    # ---- crash debris --------------------------------------------------------------------------------------
    def cleanup(self, now: float | None = None) -> list[str]:
        """Remove what crashed writers left: temp folders whose owner is gone, and stage folders that were
        renamed into a table but never got a commit record. Runs under the commit lock, so it never races a
        commit's renames or a temp folder's creation (see `_claim_tmp`). Kept: temp folders of live writers
        of this host, of other hosts unless older than FOREIGN_TMP_TTL_S (by the owner record's `created`, or
        its modification time for a record written before that field existed), and the stage folders of
        invalid records (the stage's re-run replaces them)."""
        removed = []
        host = socket.gethostname()
        now = time.time() if now is None else now
        with self.lock("commit"):
            for tmp in self.fs.glob(self.path(".tmp", "*")):
                try:
                    with self.fs.open(f"{tmp}/owner.json", "r") as f:
                        owner = json.load(f)
                    if not isinstance(owner, dict):
                        owner = {}
                except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
                    owner = {}  # claimed folders always hold their owner record: this one is debris
                if owner.get("host") == host:
                    if _pid_alive(owner.get("pid")):
                        continue
                elif owner:
                    created = owner.get("created")
                    if not isinstance(created, (int, float)):  # an owner record from before `created` existed
                        created = _modified(self.fs, f"{tmp}/owner.json")
                    if created is None or now - created < FOREIGN_TMP_TTL_S:
                        continue  # another host's writer may still be at work
                try:
                    self.fs.rm(tmp, recursive=True)
                except FileNotFoundError:
                    continue
                removed.append(tmp)
            records, bad = self.scan_records()
            landed = {p.rsplit("/", 1)[0] for r in records for t in r["tables"].values() for p in t["paths"]}
            invalid = {p for p, _ in bad}
            for table in TABLES:
                for stage_dir in self.fs.glob(self.path(table, "run_id=*", "round=*", "stage=*")):
                    rel = stage_dir[len(self.root) + 1 :]
                    if rel in landed:
                        continue
                    _, run_part, round_part, stage_part = rel.split("/")
                    if self.path("_landed", run_part, round_part, stage_part[len("stage="):] + ".json") in invalid:
                        continue  # keep the data of an invalid record: the stage's re-run replaces both
                    self.fs.rm(stage_dir, recursive=True)
                    removed.append(stage_dir)
        return removed


PART_ROWS = 50_000  # a stage's table is written as parts of about this many rows, in parallel


def _split(t: pa.Table) -> list[pa.Table]:
    n = max(1, min(os.cpu_count() or 1, -(-t.num_rows // PART_ROWS)))
    size = -(-t.num_rows // n) if t.num_rows else 0
    return [t.slice(i * size, size) for i in range(n)]


def _report(path: str, problem: str) -> None:
    """Log a skipped `_landed/` file once per process, in one line that names it."""
    if (path, problem) not in _reported:
        _reported.add((path, problem))
        log.warning("skipping %s: %s", path, problem)


def _modified(fs, path: str) -> float | None:
    """`path`'s modification time (epoch seconds) on `fs`, or None if the filesystem cannot say."""
    try:
        return fs.modified(path).timestamp()
    except Exception:  # NotImplementedError on some filesystems; then look in info() under the usual names
        pass
    try:
        info = fs.info(path)
    except Exception:
        return None
    for key in ("mtime", "LastModified", "updated", "last_modified"):
        value = info.get(key)
        if isinstance(value, (int, float)):
            return float(value)
        if hasattr(value, "timestamp"):
            return value.timestamp()
    return None


def _pid_alive(pid) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
