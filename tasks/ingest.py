"""Ingestion stage: validated source rows become `prompts` rows, exactly once.

Prompt ids are content hashes, and the read-dedup-commit sequence runs under the store's `prompts` lock,
so concurrent ingests of overlapping sources both succeed and leave no duplicate. The landed ids are read
with pyarrow and their text checked: a data file whose footer reads (storage/integrity.py checks footers) but
whose `prompt_id` pages hold junk is named as corrupt in one line, where polars raised a ComputeError naming
no file (or panicked), and ids that do not decode are never compared as if they were ids.

Ingest is a Prefect task but not a round stage (tasks/stage.py): it belongs to no run or round, its commit is
named by the prompts it adds (known only under the lock, so there is no record to check before it runs: an
ingest whose rows all landed already adds nothing instead), it generates nothing, and it claims no share of
the cores for torch (the stage skeleton would import torch and count the ingest as a torch process).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from prefect import get_run_logger, task
from prefect.exceptions import MissingContextError

from storage.integrity import DamagedStore
from storage.query import table_rows_with_schema
from storage.store import Store
from tasks.core.ids import digest
from tasks.core.sources import BadRow, Limits, SourceRow, file_rows, rg_rows


class IngestRejected(ValueError):
    """A source had bad rows and --skip-invalid was not given; nothing was written."""

    def __init__(self, source: str, bad: list[BadRow]):
        self.bad = bad
        super().__init__(f"{source}: rejected, {len(bad)} bad row(s), nothing written:\n" + "\n".join(map(str, bad)))


@dataclass
class IngestSummary:
    source: str
    read: int
    new: int
    already_present: int
    duplicates_in_source: int
    skipped: list[str] = field(default_factory=list)
    stage: str | None = None

    def __str__(self) -> str:
        s = (
            f"{self.source}: {self.read} rows read, {self.new} new prompts landed, "
            f"{self.already_present} already in the store, {self.duplicates_in_source} duplicates within the source"
        )
        if self.skipped:
            s += f", {len(self.skipped)} invalid rows skipped"
        return s


def load_source(
    source: str,
    size: int = 100,
    seed: int = 0,
    params: dict | None = None,
    source_name: str | None = None,
    limits: Limits | None = None,
    rg_solutions: bool = True,
) -> tuple[list[SourceRow], list[BadRow]]:
    """Rows from `rg:<task>` (with worked solutions where `rg_solutions` and one can be written) or a
    .jsonl/.parquet path, with the bad ones reported separately."""
    if source.startswith("rg:"):
        return rg_rows(source[3:], size, seed, params or {}, rg_solutions), []
    if params:
        raise ValueError("--param only applies to rg: sources")
    return file_rows(source, source_name, limits or Limits())


def prompts_table(rows: list[SourceRow]) -> pa.Table:
    now = datetime.now(UTC)
    ids = [r.prompt_id for r in rows]
    return pa.table({
        "prompt_id": ids,
        "text": [r.text for r in rows],
        "answer": [r.answer for r in rows],
        "solution": [r.solution for r in rows],
        "source": [r.source for r in rows],
        "params": [r.params for r in rows],
        "parent_id": pa.nulls(len(rows), pa.string()),
        "root_id": ids,
        "transform": ["original"] * len(rows),
        "created_at": pa.array([now] * len(rows), pa.timestamp("us", tz="UTC")),
        "meta": [r.meta for r in rows],
        "external_id": [r.external_id for r in rows],
    })


def landed_prompt_ids(store: Store) -> pa.ChunkedArray:
    """The prompt ids in the store, or DamagedStore naming the data file whose ids do not read (module docstring)."""
    try:
        ids = table_rows_with_schema(store, "prompts", ["prompt_id"])["prompt_id"].to_arrow()
        ids.validate(full=True)  # junk over a page may decode as bytes that are not UTF-8
        return ids
    except (pa.ArrowException, OSError) as e:
        raise _corrupt_file(store, e) from None


def _corrupt_file(store: Store, error: Exception) -> Exception:
    """A DamagedStore naming the first prompts file whose ids do not read; `error` itself if each reads alone."""
    for f in store.files("prompts"):
        try:
            pq.read_table(f, columns=["prompt_id"], filesystem=None if store.local else store.fs).validate(full=True)
        except (pa.ArrowException, OSError) as e:
            rel = os.path.relpath(f, store.root) if store.local else f
            detail = str(e).splitlines()[0] if str(e) else type(e).__name__
            return DamagedStore(f"store {store.root}: prompts data file {rel} is corrupt: its prompt_id column does "
                                f"not read ({detail}); restore it from a copy of the store")
    return error


def commit_prompts(store: Store, rows: list[SourceRow]) -> tuple[int, int, str | None]:
    """Land the rows whose prompt_id is not yet in the store. Returns (new, already_present, stage)."""
    unique = list({r.prompt_id: r for r in rows}.values())
    if not unique:  # every row was invalid and skipped: nothing to land, no stage
        return 0, 0, None
    with store.lock("prompts"):
        existing = landed_prompt_ids(store)
        table = prompts_table(unique)
        fresh = table.filter(pc.invert(pc.is_in(table["prompt_id"], existing)))
        if fresh.num_rows == 0:
            return 0, len(unique), None
        # The stage name is a hash of what it adds, so a retried identical ingest is the same stage.
        stage = f"ingest-{digest(''.join(sorted(fresh['prompt_id'].to_pylist())))}"
        store.commit(stage, {"prompts": fresh})
        return fresh.num_rows, len(unique) - fresh.num_rows, stage


def ingest_source(
    store: Store,
    source: str,
    size: int = 100,
    seed: int = 0,
    params: dict | None = None,
    skip_invalid: bool = False,
    source_name: str | None = None,
) -> IngestSummary:
    """Validate a whole source, then land its new prompts in one commit (or nothing, if any row is bad; with
    `skip_invalid`, a source whose every row is bad lands nothing and returns a summary with no stage)."""
    rows, bad = load_source(source, size, seed, params, source_name)
    if bad and not skip_invalid:
        raise IngestRejected(source, bad)
    new, present, stage = commit_prompts(store, rows)
    n_unique = len({r.prompt_id for r in rows})
    return IngestSummary(
        source=source,
        read=len(rows) + len(bad),
        new=new,
        already_present=present,
        duplicates_in_source=len(rows) - n_unique,
        skipped=[str(b) for b in bad],
        stage=stage,
    )


@task(name="ingest-source", retries=0)
def ingest_task(store_uri: str, source: str, size: int, seed: int, params: dict, skip_invalid: bool,
                source_name: str | None) -> dict:
    summary = ingest_source(Store(store_uri), source, size, seed, params, skip_invalid, source_name)
    try:
        logger = get_run_logger()
        logger.info(str(summary))
        for line in summary.skipped:
            logger.warning("skipped %s", line)
    except MissingContextError:
        pass
    return summary.__dict__
