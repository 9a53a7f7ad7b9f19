"""Crash debris: what writers that died left in a store, and the rule for removing it safely.

Temp folders are claimed atomically: a writer creates `.tmp/<uuid>` and its `owner.json` under the commit
lock (storage/store.py, `Store._claim_tmp`), which `remove_debris` holds for its whole scan, so it never sees a
folder without its owner. On a remote root the owner record is the folder's first object (object stores have
no empty folders). A folder is removed when its owner is this host and a dead pid, or its owner record is
missing (debris of a crash), and a folder of another host only when it is older than `FOREIGN_TMP_TTL_S` (it
cannot tell whether that host's writer is alive). Stage folders that were renamed into a table but never got a
commit record are removed too, except those of an invalid record (storage/records.py): the stage's re-run
replaces both, and until then that folder may be all that is left of an ingest. On an object store (no
renames) a stage's parts sit in `stage=<stage>/attempt=<uuid>` from the start; an attempt folder no record
lists is removed once its claim `.tmp/<uuid>` is gone.
"""

from __future__ import annotations

import json
import os
import socket
import time

from storage.schemas import TABLES

FOREIGN_TMP_TTL_S = 24 * 3600  # another host's temp folder is removed only when its owner record is this old


def remove_debris(store, now: float | None = None) -> list[str]:
    """Remove what crashed writers left in `store` (a storage.store.Store) and return the removed paths: temp
    folders whose owner is gone, and stage folders that were renamed into a table but never got a commit
    record. Runs under the commit lock, so it never races a commit's renames or a temp folder's creation. Kept:
    temp folders of live writers of this host, of other hosts unless older than FOREIGN_TMP_TTL_S (by the
    owner record's `created`, or its modification time for a record written before that field existed), and
    the stage folders of invalid records (the stage's re-run replaces them)."""
    removed = []
    host = socket.gethostname()
    now = time.time() if now is None else now
    with store.lock("commit"):
        for tmp in store.fs.glob(store.path(".tmp", "*")):
            try:
                with store.fs.open(f"{tmp}/owner.json", "r") as f:
                    owner = json.load(f)
                if not isinstance(owner, dict):
                    owner = {}
            except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
                owner = {}  # claimed folders always hold their owner record: this one is debris
            if owner.get("host") == host:
                if pid_alive(owner.get("pid")):
                    continue
            elif owner:
                created = owner.get("created")
                if not isinstance(created, (int, float)):  # an owner record from before `created` existed
                    created = modified_time(store.fs, f"{tmp}/owner.json")
                if created is None or now - created < FOREIGN_TMP_TTL_S:
                    continue  # another host's writer may still be at work
            try:
                store.fs.rm(tmp, recursive=True)
            except FileNotFoundError:
                continue
            removed.append(tmp)
        records, bad = store.scan_records()
        landed = {p.rsplit("/", 1)[0] for r in records for t in r["tables"].values() for p in t["paths"]}
        invalid = {p for p, _ in bad}
        if getattr(store, "object_store", False):
            claims = {t.rsplit("/", 1)[1] for t in store.fs.glob(store.path(".tmp", "*"))}
            removed += _remove_attempts(store, landed, claims)
            return removed
        for table in TABLES:
            for stage_dir in store.fs.glob(store.path(table, "run_id=*", "round=*", "stage=*")):
                rel = stage_dir[len(store.root) + 1 :]
                if rel in landed:
                    continue
                _, run_part, round_part, stage_part = rel.split("/")
                if store.path("_landed", run_part, round_part, stage_part[len("stage="):] + ".json") in invalid:
                    continue  # keep the data of an invalid record: the stage's re-run replaces both
                store.fs.rm(stage_dir, recursive=True)
                removed.append(stage_dir)
    return removed


def _remove_attempts(store, landed: set[str], claims: set[str]) -> list[str]:
    """Object stores: the attempt folders (`stage=<stage>/attempt=<uuid>`) that no commit record lists and
    whose claim `.tmp/<uuid>` is gone (its writer committed elsewhere, or crashed and its claim was removed
    above). A claim that is still there is a writer at work, or one whose debris the rule above keeps."""
    removed = []
    for table in TABLES:
        for attempt in store.fs.glob(store.path(table, "run_id=*", "round=*", "stage=*", "attempt=*")):
            rel = attempt[len(store.root) + 1 :]
            if rel in landed or rel.rsplit("attempt=", 1)[1] in claims:
                continue
            store.fs.rm(attempt, recursive=True)
            removed.append(attempt)
    return removed


def modified_time(fs, path: str) -> float | None:
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


def pid_alive(pid) -> bool:
    """Is there a process with this pid on this host (one we may not signal counts as alive)?"""
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
