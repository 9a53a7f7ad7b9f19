"""The ingest flow: validate one source and land its new prompts (a run's own pool sources are landed by
the curriculum flow's pool stage; see flows/config.py for the default pool). `refinery ingest` checks a file's
rows before the flow starts (`check_rows`), so a refused file leaves no store or Prefect home behind; the flow
validates them again, as a deployment's run reaches it without the CLI."""

from __future__ import annotations

from typing import Any

from prefect import flow

from storage.store import Store, default_root
from tasks.ingest import IngestRejected, IngestSummary, ingest_task, load_source


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


def check_rows(source: str, params: dict, skip_invalid: bool, source_name: str | None) -> dict | None:
    """A file's rows, read and validated as the flow will validate them: a bad row refuses the file here
    (IngestRejected, unless `skip_invalid`); a file with no valid row returns its summary (IngestSummary's
    fields), as there is nothing for a flow to land. None: the flow has rows to land."""
    if source.startswith("rg:"):
        return None
    rows, bad = load_source(source, params=params, source_name=source_name)
    if bad and not skip_invalid:
        raise IngestRejected(source, bad)
    return None if rows else IngestSummary(source, len(bad), 0, 0, 0, [str(b) for b in bad]).__dict__
