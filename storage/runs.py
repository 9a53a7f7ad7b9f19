"""The `runs` table and the run lock.

`runs` has one row per status change of a run: running, resumed, completed, failed. A run's current status
is its latest row, and each change is its own tiny stage, so it is atomic too. Each row records the host and
PID of the process that wrote it, and the commit of its code and whether that code had uncommitted changes
(storage/provenance.py). Its `config` is the run's config without `store`: where the run lives is the store the
row is in, so a moved, copied or committed store never names its old place; `stored_config` gives it back as
the store it was read from (rows written before name the path they were started with, which is ignored).

The run lock keeps two processes (a CLI run, a deployment's flow run, a rescore) from working on the same
run id at once. It is an OS file lock (`Store.lock`), so the kernel releases it when its holder dies, even
by SIGKILL. Whoever takes the lock next and finds the run's latest row still `running`/`resumed` knows that
holder died without saying so, and records `failed` before resuming: `runs` then tells the whole story.
On an `s3://` store the file lock excludes processes of one machine only, so the run lock also takes a lease
object in the bucket (storage/lease.py: a conditional PUT, renewed while held, taken over once expired): a
second host on the same run id is refused, naming the holder.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime

import polars as pl
import pyarrow as pa
from filelock import Timeout

from storage import lease
from storage.provenance import code_version
from storage.query import scan
from storage.store import Store

LIVE = ("running", "resumed")


class RunLocked(RuntimeError):
    """Another process holds the run's lock."""

    user_facing = True  # the CLI prints it as a one-line reason


def run_rows(store: Store, run_id: str) -> pl.DataFrame:
    return scan(store, "runs").filter(pl.col("run_id") == run_id).sort("created_at").collect()


def _row(run_id: str, status: str, config: dict, reason: str | None = None) -> pa.Table:
    commit, dirty = code_version()
    recorded = {k: v for k, v in config.items() if k != "store"}  # where it lives: the store the row is in
    return pa.table({"run_id": [run_id], "created_at": [datetime.now(UTC)], "status": [status],
                     "config": [json.dumps(recorded, sort_keys=True)], "host": [socket.gethostname()],
                     "pid": pa.array([os.getpid()], pa.int64()), "reason": pa.array([reason], pa.string()),
                     "commit": [commit], "dirty": pa.array([dirty], pa.bool_())})


def mark(store: Store, run_id: str, status: str, config: dict, reason: str | None = None) -> str:
    """Append a status row; returns the status written ('running' becomes 'resumed' for a known run)."""
    previous = run_rows(store, run_id)
    if status == "running" and previous.height:
        status = "resumed"
    store.commit(f"{status}-{previous.height}", {"runs": _row(run_id, status, config, reason)}, run_id=run_id)
    return status


def stored_config(store: Store, run_id: str) -> dict | None:
    """The run's latest config (a resume may have changed a field that cannot change landed data), with `store`
    the store it was read from."""
    rows = run_rows(store, run_id)
    return {**json.loads(rows["config"][-1]), "store": store.uri} if rows.height else None


def _holder(store: Store, run_id: str) -> str:
    rows = run_rows(store, run_id)
    if rows.height == 0:
        return "another process"
    last = rows.row(-1, named=True)
    where = f"pid {last['pid']} on {last['host']}" if last.get("pid") is not None else "another process"
    return f"{where}, {last['status']} since {last['created_at']:%Y-%m-%d %H:%M:%S} UTC"


@contextmanager
def run_lock(store: Store, run_id: str) -> Iterator[None]:
    """Hold run `run_id`'s lock, or raise RunLocked at once naming the holder. On entry, a run whose latest
    row is still live was abandoned by a dead process: it is marked `failed` (with the dead writer's config)."""
    with ExitStack() as held:
        try:
            held.enter_context(store.lock(f"run-{run_id}", timeout=0))
        except Timeout:
            raise RunLocked(f"run {run_id} is already running ({_holder(store, run_id)}); wait for it to finish, "
                            "or choose another run id") from None
        if lease.supported(store):
            try:
                held.enter_context(lease.held(store, f"run-{run_id}"))
            except lease.LeaseHeld as e:
                raise RunLocked(f"run {run_id} is already running ({e}); wait for it to finish, or choose "
                                "another run id") from None
        rows = run_rows(store, run_id)
        if rows.height and rows["status"][-1] in LIVE:
            last = rows.row(-1, named=True)
            who = f" (pid {last['pid']} on {last['host']})" if last.get("pid") is not None else ""
            reason = f"the process that ran it{who} ended without finishing; found by pid {os.getpid()}"
            mark(store, run_id, "failed", json.loads(last["config"]), reason)
        yield
