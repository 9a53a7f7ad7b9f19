"""Ingestion flows: one source, or the default prompt pool of the embedded-model demo.

The default pool (DESIGN.md, issue 3) mixes problems the embedded SmolLM2-135M solves about a third of the
time, so most groups are mixed: 1-digit products, 1-digit +/- arithmetic and 2-term 1-digit chain sums,
plus a few at harder settings so that the too_hard bucket is not empty.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from storage.store import Store, default_root
from tasks.ingest import ingest_task

DEFAULT_POOL: list[dict] = [
    {"source": "rg:products", "size": 32, "params": {"max_digits": 1}},
    {"source": "rg:basic_arithmetic",
     "size": 32, "params": {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+", "-"],
                            "allow_parentheses": False, "allow_negation": False}},
    {"source": "rg:chain_sum", "size": 32, "params": {"min_terms": 2, "max_terms": 2, "max_digits": 1}},
    {"source": "rg:products", "size": 8, "params": {"min_digits": 2, "max_digits": 2}},
    {"source": "rg:chain_sum", "size": 8, "params": {"min_terms": 3, "max_terms": 4, "min_digits": 2, "max_digits": 2}},
]


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


@flow(name="ingest-pool")
def ingest_pool(seed: int = 0, store: str | None = None, pool: list[dict] | None = None) -> list[dict]:
    """Land every source of `pool` (default: DEFAULT_POOL). Re-running adds nothing that is already there."""
    s = Store(store or default_root())
    s.cleanup()
    return [
        ingest_task(s.uri, spec["source"], spec.get("size", 100), seed, spec.get("params", {}), False, None)
        for spec in (pool or DEFAULT_POOL)
    ]
