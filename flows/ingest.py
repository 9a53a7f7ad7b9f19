"""The ingest flow: validate one source and land its new prompts (a run's own pool sources are landed by
the curriculum flow's pool stage; see flows/config.py for the default pool)."""

from __future__ import annotations

from typing import Any

from prefect import flow

from storage.store import Store, default_root
from tasks.ingest import ingest_task


@flow(name="ingest", validate_parameters=True)
def ingest(
    source: str,
    size: int = 100,
    seed: int = 0,
    params: dict[str, Any] | None = None,
    skip_invalid: bool = False,
    source_name: str | None = None,
    store: str | None = None,
) -> dict:
    """Validate `source` (rg:<task> or a .jsonl/.parquet path) and land its new prompts in the store."""
    s = Store(store or default_root())
    s.cleanup()
    return ingest_task(s.uri, source, size, seed, params or {}, skip_invalid, source_name)
