"""Pool stage: the run's prompt membership for a round (docs/algorithms.md §2).

Round 0 lands the configured sources (ingestion is idempotent: content-addressed ids) and makes their
prompts active, except a held-out share (status 'heldout', fixed for the run; tasks/core/heldout.py: twins
together and every source entry represented under eval.heldout_split 'stratified', whose rows record their
`stratum`).
Later rounds derive membership from the previous round's pool and scores
(`tasks/core/pool_rules.py`): non-informative originals go to reserve, reserve prompts that recover come back.
The scores it reads are the policy's own samples (tasks/core/eps.py): a LoPE-rescued group counts as
too_hard, so its original moves to reserve rather than staying active on its replacements.
"""

from __future__ import annotations

from typing import Any, ClassVar

import polars as pl
from pydantic import Field, field_validator

from models.config import Section
from storage.rounds import prompts, this_round
from storage.store import Store
from tasks.core.heldout import heldout_roots, stratified_heldout, stratum_name, twin_key
from tasks.core.pool_rules import next_pool
from tasks.ingest import commit_prompts, load_source
from tasks.stage import RoundContext, stage


class SourceSpec(Section):
    """One prompt source of the run's pool."""

    source: str = Field(description="`rg:<reasoning-gym task>`, or a .jsonl/.parquet path")
    size: int = Field(100, ge=1, le=1_000_000, description="rg: how many prompts to generate")
    params: dict[str, Any] = Field(default_factory=dict, description="rg: difficulty fields")


# The embedded-model demo's pool: problems SmolLM2-135M solves about a third of the time, so most groups
# are mixed, plus a few at harder settings so that the too_hard bucket is not empty.
DEFAULT_SOURCES = [
    SourceSpec(source="rg:products", size=20, params={"max_digits": 1}),
    SourceSpec(source="rg:basic_arithmetic", size=20, params={
        "min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+", "-"],
        "allow_parentheses": False, "allow_negation": False}),
    SourceSpec(source="rg:chain_sum", size=16, params={"min_terms": 2, "max_terms": 2, "max_digits": 1}),
    SourceSpec(source="rg:products", size=4, params={"min_digits": 2, "max_digits": 2}),
    SourceSpec(source="rg:chain_sum", size=4, params={"min_terms": 3, "max_terms": 4, "min_digits": 2, "max_digits": 2}),
]


class PoolConfig(Section):
    """The prompt sources of round 0 (docs/algorithms.md §2)."""

    sources: list[SourceSpec] = Field(default_factory=lambda: [s.model_copy() for s in DEFAULT_SOURCES],
                                      description="where the run's prompts come from (at least one)",
                                      json_schema_extra={"minItems": 1})
    seed: int = Field(0, ge=0, description="generator seed for rg: sources")
    rg_solutions: bool = Field(True, description="rg: prompts carry a worked reference solution where "
                               "tasks/core/worked_solutions.py can write one (products, basic_arithmetic, "
                               "chain_sum, gcd, lcm): it enables hint_prefix and reference-started shaping")

    # a run stored before rg_solutions existed landed its rg: prompts without solutions (flows/config.py)
    absent_means: ClassVar[dict] = {"rg_solutions": False}

    @field_validator("sources")
    @classmethod
    def _some_source(cls, v: list[SourceSpec]) -> list[SourceSpec]:
        if not v:
            raise ValueError("is empty: a run needs at least one source (rg:<task> or a .jsonl/.parquet file)")
        return v


def initial_pool(store: Store, run_id: str, cfg: PoolConfig, heldout_fraction: float = 0.0,
                 heldout_seed: int = 0, heldout_split: str = "flat") -> pl.DataFrame:
    """Round 0's pool: every source's prompts, `heldout_fraction` of them held out by `heldout_split`
    (tasks/core/heldout.py). Under "stratified" each row records its stratum, the first source entry that
    lists the prompt; under "flat" `stratum` stays null, as rows were written before it existed."""
    strata: dict[str, str] = {}  # prompt_id -> stratum
    keys: dict[str, str] = {}  # prompt_id -> twin key
    for spec in cfg.sources:
        rows, bad = load_source(spec.source, spec.size, cfg.seed, dict(spec.params), rg_solutions=cfg.rg_solutions)
        if bad:
            raise ValueError(f"pool source {spec.source}: {len(bad)} bad row(s), e.g. {bad[0]}")
        commit_prompts(store, rows)
        name = stratum_name(spec.source, dict(spec.params))
        for r in rows:
            strata.setdefault(r.prompt_id, name)
            keys.setdefault(r.prompt_id, twin_key(r.text, r.answer))
    unique = sorted(strata)
    stratified = heldout_split == "stratified"
    if stratified:  # strata in config order: the order `stratified_heldout` fills them
        heldout = stratified_heldout(((p, strata[p], keys[p]) for p in strata), heldout_fraction, heldout_seed)
    else:
        heldout = heldout_roots(unique, heldout_fraction, heldout_seed)  # round-0 prompts are their own roots
    return pl.DataFrame({"run_id": [run_id] * len(unique), "round": [0] * len(unique), "prompt_id": unique,
                         "status": ["heldout" if p in heldout else "active" for p in unique],
                         "level": [None] * len(unique),
                         "stratum": [strata[p] if stratified else None for p in unique]},
                        schema={"run_id": pl.String, "round": pl.Int32, "prompt_id": pl.String,
                                "status": pl.String, "level": pl.String, "stratum": pl.String})


@stage("pool")
def pool_task(ctx: RoundContext, store: Store, cfg: PoolConfig, heldout_fraction: float = 0.0,
              heldout_seed: int = 0, heldout_split: str = "flat") -> dict:
    """Round 0: land the sources and split off the held-out share. Later rounds: `next_pool` over the previous
    round's pool, scores and refinements."""
    if ctx.round == 0:
        pool = initial_pool(store, ctx.run_id, cfg, heldout_fraction, heldout_seed, heldout_split)
    else:
        def prev(table: str) -> pl.DataFrame:
            return this_round(store, table, ctx.run_id, ctx.round - 1).collect()

        pool = next_pool(prev("pool"), prev("prompt_scores"), prompts(store, "transform").collect(), ctx.round,
                         prev("refinements"))
    store.commit("pool", {"pool": pool.to_arrow()}, run_id=ctx.run_id, round=ctx.round)
    return {"status": dict(pool.group_by("status").len().iter_rows())}
