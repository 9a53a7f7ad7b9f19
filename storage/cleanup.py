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
    object_store = getattr(store, "object_store", False)
    with store.lock("commit"):
        if object_store:  # other hosts write meanwhile: list afresh, and attempts before claims before records
            store.fs.invalidate_cache()
            attempts = [a for table in TABLES
                        for a in store.fs.glob(store.path(table, "run_id=*", "round=*", "stage=*", "attempt=*"))]
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
        if object_store:
            store.fs.invalidate_cache()
            claims = {t.rsplit("/", 1)[1] for t in store.fs.glob(store.path(".tmp", "*"))}
            records, bad = store.scan_records()  # after the claims: a claim is removed only after its record
            named = {p.rsplit("/", 1)[0] for r in records for t in r["tables"].values() for p in t["paths"]}
            gone = {t.rsplit("/", 1)[1] for t in removed}
            removed += _remove_attempts(store, attempts, named, claims, gone, bool(bad), now)
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


def _remove_attempts(store, attempts: list[str], named: set[str], claims: set[str], gone: set[str],
                     invalid_records: bool, now: float) -> list[str]:
    """Object stores: remove the attempt folders (`stage=<stage>/attempt=<uuid>`, listed before the claims and
    the records) that no valid record names and whose writer is known to be gone: its claim was removed in
    this pass (a dead writer of this host, or another host's past FOREIGN_TMP_TTL_S), or it has no claim and
    its newest object is older than FOREIGN_TMP_TTL_S (a claim can vanish because its writer committed, which
    the records listed after the claims show, or lost a race for the same stage). While any record is invalid,
    only attempts whose claim this pass removed go: an invalid record may still name its data."""
    removed = []
    for attempt in attempts:
        rel = attempt[len(store.root) + 1 :]
        uuid = rel.rsplit("attempt=", 1)[1]
        if rel in named or uuid in claims:
            continue
        if uuid not in gone:
            if invalid_records:
                continue
            newest = max((modified_time(store.fs, f) or now for f in store.fs.find(attempt)), default=now)
            if now - newest < FOREIGN_TMP_TTL_S:
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
