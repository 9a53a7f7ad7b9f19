"""The `runs` table: one row per status change of a run (running, resumed, completed, failed).

A run's current status is its latest row. Each change is its own tiny stage, so it is atomic too.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

import polars as pl
import pyarrow as pa

from storage.query import scan
from storage.store import Store


def run_rows(store: Store, run_id: str) -> pl.DataFrame:
    return scan(store, "runs").filter(pl.col("run_id") == run_id).sort("created_at").collect()


def mark(store: Store, run_id: str, status: str, config: dict) -> str:
    """Append a status row; returns the status written ('running' becomes 'resumed' for a known run)."""
    previous = run_rows(store, run_id)
    if status == "running" and previous.height:
        status = "resumed"
    stage = f"{status}-{previous.height}"
    row = pa.table({"run_id": [run_id], "created_at": [datetime.now(UTC)], "status": [status],
                    "config": [json.dumps(config, sort_keys=True)]})
    store.commit(stage, {"runs": row}, run_id=run_id)
    return status


def stored_config(store: Store, run_id: str) -> dict | None:
    rows = run_rows(store, run_id)
    return json.loads(rows["config"][0]) if rows.height else None
