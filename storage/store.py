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

Object stores (s3://, gs://, az://...) have no folders and no rename: a "move" is a copy of every object and
a delete, neither atomic nor cheap. There the commit writes each table's parts straight to their final
place, in a folder of their own attempt, `<table>/run_id=<run>/round=<round>/stage=<stage>/attempt=<uuid>/`
(the uuid of the attempt's `.tmp/<uuid>` claim, which holds only its owner record), and then PUTs the commit
record, which an object store makes visible whole or not at all. The record is still the one commit point:
until it exists no reader lists the attempt's files, and a crashed attempt's files stay unlisted debris that
`cleanup` removes once their claim is gone. S3-compatible endpoints and credentials come from the standard
`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` (s3fs reads them).

This module is over 300 lines because the commit's two paths (rename into place; write in place on object
stores) share their claim, lock, record and cleanup rules, and splitting them would spread one protocol over
two files. Around this module: storage/records.py reads and validates commit records (an invalid one is reported and
counts as not landed), storage/cleanup.py removes what crashed writers left (`Store.cleanup`). The temp folder
is claimed with its owner record under the commit lock, the one cleanup holds while it scans.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
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

from storage.cleanup import FOREIGN_TMP_TTL_S, remove_debris
from storage.integrity import check_files
from storage.records import NO_ROUND, NO_RUN, partition, read_record, record_path, scan_records
from storage.schemas import conform, schema

__all__ = ["DEFAULT_ROOT", "FOREIGN_TMP_TTL_S", "NO_ROUND", "NO_RUN", "PART_ROWS", "Commit", "Store", "check_name",
           "default_root", "fault_point"]

log = logging.getLogger("refinery.store")

DEFAULT_ROOT = "./refinery-store"
OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "adl"}  # no folders, no rename
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


# store URI -> why this process may no longer commit there (it lost a run's lease: storage/lease.py); every
# Store object of that URI in the process refuses to commit, since stages open their own.
FENCES: dict[str, str] = {}


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
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        self.object_store = any(p in OBJECT_STORES for p in protocols)
        self.root = os.path.abspath(path) if self.local else path.rstrip("/")
        # (run_id, round, stage) -> tables that ride along in that stage's commit, computed when it commits
        # (the stage wrapper puts its generated-token counts here: they land atomically with the stage)
        self.riders: dict[tuple[str | None, int | None, str], Callable[[], Mapping[str, pa.Table]]] = {}

    def __repr__(self) -> str:
        return f"Store({self.uri!r})"

    # ---- paths ---------------------------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    # ---- locks ---------------------------------------------------------------------------------------------
    @contextmanager
    def lock(self, name: str, timeout: float = 600.0) -> Iterator[None]:
        """An inter-process lock. Local roots keep it in <root>/.locks; remote roots in a local cache folder,
        which serialises writers on this machine only; across machines an s3:// store's run lock is a lease
        (storage/lease.py)."""
        if self.local:
            folder = Path(self.root, ".locks")
        else:
            import hashlib

            digest = hashlib.sha256(self.uri.encode()).hexdigest()[:16]  # tasks.core.ids.ID_HEX (storage imports no task)
            folder = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "refinery", "locks", digest)
        folder.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder / f"{name}.lock"), timeout=timeout):
            yield

    # ---- commit --------------------------------------------------------------------------------------------
    def landed(self, run_id: str | None, round: int | None, stage: str) -> bool:
        """Has this stage of this run and round been committed? Resume logic asks this. A record that is
        invalid (see storage/records.py) is reported and counts as not landed: the stage runs again and
        replaces it."""
        self._fresh()
        return read_record(self.fs, self.root, record_path(self.root, run_id, round, stage)) is not None

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
        rider = self.riders.get((run_id, round, stage))
        if rider is not None:
            tables = {**tables, **rider()}
        conformed = {name: conform(name, t) for name, t in tables.items()}
        part = partition(run_id, round)
        stage_dir = f"stage={stage}"

        tmp = self._claim_tmp()
        if self.object_store:
            return self._commit_in_place(tmp, conformed, run_id, round, stage)
        jobs = []
        for name, t in conformed.items():
            folder = "/".join([tmp, name, *part, stage_dir])
            self.fs.makedirs(folder, exist_ok=True)
            jobs += [(f"{folder}/part-{i}.parquet", chunk) for i, chunk in enumerate(_split(t))]
        self._write_parts(jobs)
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
            self._write_atomic(record_path(self.root, run_id, round, stage), self._record(run_id, round, stage, files))
            self.fs.rm(tmp, recursive=True)
        return self._landed_now(run_id, round, stage, conformed)

    def _fresh(self) -> None:
        """Object stores: forget cached listings (s3fs keeps them for the process's life), since other
        processes and hosts land stages meanwhile."""
        if self.object_store:
            self.fs.invalidate_cache()

    def _record(self, run_id: str | None, round: int | None, stage: str, files: dict) -> str:
        """The commit record's text; refused if this process was fenced off the store (lost a run lease)."""
        self._check_fence()
        return json.dumps({"run_id": run_id, "round": round, "stage": stage, "tables": files,
                           "committed_at": datetime.now(UTC).isoformat()}, indent=1)

    @staticmethod
    def _landed_now(run_id: str | None, round: int | None, stage: str, conformed: Mapping[str, pa.Table]) -> Commit:
        result = Commit(run_id, round, stage, landed_now=True, rows={n: t.num_rows for n, t in conformed.items()})
        log.info(result.message)
        return result

    def _check_fence(self) -> None:
        """Refuse to commit once this process lost a run lease on this store (storage/lease.py): another host
        may own the run now."""
        reason = FENCES.get(self.uri.rstrip("/"))
        if reason:
            raise RuntimeError(reason)

    def _write_parts(self, jobs: list[tuple[str, pa.Table]]) -> None:
        with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
            list(pool.map(lambda job: self._write_parquet(*job), jobs))  # pyarrow releases the GIL

    def _commit_in_place(self, tmp: str, conformed: Mapping[str, pa.Table], run_id: str | None,
                         round: int | None, stage: str) -> Commit:
        """The object-store commit: parts written where they stay, in the attempt's own folder, then the
        commit record in one PUT (module docstring)."""
        attempt = f"attempt={tmp.rsplit('/', 1)[1]}"
        rel = {name: "/".join([name, *partition(run_id, round), f"stage={stage}", attempt]) for name in conformed}
        jobs = [(self.path(rel[name], f"part-{i}.parquet"), chunk)
                for name, t in conformed.items() for i, chunk in enumerate(_split(t))]
        self._write_parts(jobs)
        fault_point("commit:written")
        with self.lock("commit"):
            if self.landed(run_id, round, stage):  # another writer landed it first: ours stays debris
                self.fs.rm(tmp, recursive=True)
                return Commit(run_id, round, stage, landed_now=False)
            files = {name: {"paths": [f"{rel[name]}/part-{i}.parquet" for i in range(len(_split(t)))],
                            "rows": t.num_rows} for name, t in conformed.items()}
            record = self._record(run_id, round, stage, files)
            try:  # create-only (If-None-Match): of two hosts landing one stage, the first record stands
                self.fs.pipe_file(record_path(self.root, run_id, round, stage), record.encode(), mode="create")
            except FileExistsError:
                for folder in set(rel.values()):
                    self.fs.rm(self.path(folder), recursive=True)
                self.fs.rm(tmp, recursive=True)
                return Commit(run_id, round, stage, landed_now=False)
            fault_point("commit:recorded")
            self.fs.rm(tmp, recursive=True)
        return self._landed_now(run_id, round, stage, conformed)

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
        if self.object_store:  # one PUT is visible whole or not at all; there is no rename to do it with
            self._write_text(path, text)
            return
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
        self._fresh()
        return scan_records(self.fs, self.root)

    def files(self, table: str, records: list[dict] | None = None) -> list[str]:
        """The data files of `table` that belong to landed stages (full paths or URIs). In a local store each
        is checked to be a regular Parquet file of the table (storage/integrity.py): a symbolic link, an
        unreadable file or one of another schema raises DamagedStore, naming it."""
        expected = schema(table)  # an unknown table is refused there, naming the store's tables
        recs = self.records() if records is None else records
        rels = sorted(p for r in recs if table in r["tables"] for p in r["tables"][table]["paths"])
        files = [self.full(rel) for rel in rels]
        if self.local:
            check_files(self.root, table, files, expected)
        return files

    def full(self, rel: str) -> str:
        if self.local:
            return self.path(rel)
        return self.fs.unstrip_protocol(self.path(rel))

    # ---- crash debris --------------------------------------------------------------------------------------
    def cleanup(self, now: float | None = None) -> list[str]:
        """Remove what crashed writers left (storage/cleanup.py) and return the removed paths."""
        return remove_debris(self, now)


PART_ROWS = 50_000  # a stage's table is written as parts of about this many rows, in parallel


def _split(t: pa.Table) -> list[pa.Table]:
    n = max(1, min(os.cpu_count() or 1, -(-t.num_rows // PART_ROWS)))
    size = -(-t.num_rows // n) if t.num_rows else 0
    return [t.slice(i * size, size) for i in range(n)]
