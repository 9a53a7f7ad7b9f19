"""The stage contract: what every curriculum stage takes, and the one skeleton all stages share.

A stage is a function `fn(ctx, store, *sections) -> dict` over one round: it reads the store's partitions,
calls the pure algorithms in tasks/core, commits one partition (`store.commit(name, ...)`) and returns a small
summary. `@stage("name")` turns it into the Prefect task the flow calls, as `name_task(ctx, *sections)`:

- it opens the `Store` at `ctx.store`;
- a stage whose commit record already exists returns `{"stage", "round", "skipped": "already landed"}`
  without running (resume is store-driven: docs/architecture.md);
- the summary gains `stage`, `round` and `timing` (the stage's own compute time: `tasks.reporting.progress.timed`);
- what the stage generates (models/meter.py: rollouts, LoPE resamples, teacher answers, MCMC proposals,
  evaluation samples) is counted and lands as `generated_tokens` rows in the stage's own commit (a rider on
  the store: storage/store.py), so the counts are there exactly when the stage is; a stage killed before
  its commit leaves neither, and its rerun counts what it generates again.

Choices, and why:
- `RoundContext` is a pydantic model, so Prefect records it as a task parameter like any config section
  and the UI shows it; it holds only what names the round (where, which run, which round, which policy), not
  data. Its `model` is the run's model section with `policy` set to the round's policy spec, so a stage
  loads this round's policy with `models.registry.load_model(ctx.model)`.
- Every stage starts by setting torch's threads to this process's share of the machine's cores
  (models/threads.py), so two runs on one machine share its cores instead of oversubscribing them.
- Tests and benchmarks call a stage without Prefect as `name_task.fn(ctx, *sections)`: the same skeleton
  (landed check, summary keys, timing), no task run.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import polars as pl
import pyarrow as pa
from prefect import task
from pydantic import BaseModel, ConfigDict, Field

from models.config import ModelConfig
from models.memory import release_memory
from models.meter import Meter, metering
from models.sharded import ScaleConfig
from models.threads import claim as claim_threads
from storage.rounds import this_round
from storage.store import Store
from tasks.reporting.progress import timed
from tasks.selectors.embed import release_embedder


class RoundContext(BaseModel):
    """Which round of which run a stage works on."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    store: str = Field(description="the store's root (a path or an s3:// URI)")
    run_id: str = Field(description="the run")
    round: int = Field(ge=0, description="the round, from 0")
    policy_version: int = Field(0, ge=0, description="the checkpoint version this round samples (0: the base)")
    base: str = Field("default", description="the run's base model spec (version 0)")
    rounds: int = Field(1, ge=1, description="rounds of the run (few-shot annealing reads it)")
    token_budget: int | None = Field(None, ge=1, description="the run's max_generated_tokens, if any: few-shot "
                                     "annealing runs over it instead of over `rounds`")
    tokens_spent: int = Field(0, ge=0, description="tokens the run generated before this round, evaluation "
                              "excluded (the figure the budget is checked against)")
    model: ModelConfig = Field(default_factory=ModelConfig, description="the model section, with `policy` "
                               "set to this round's policy spec")
    scale: ScaleConfig = Field(default_factory=ScaleConfig, description="where generation runs (Ray workers "
                               "or this process)")

    @property
    def policy(self) -> str:
        """This round's policy spec (a checkpoint folder, or the base spec at version 0)."""
        return self.model.policy

    def rows(self, store: Store, table: str) -> pl.LazyFrame:
        """This run's rows of `table` from this round (the this-round filter, in one place)."""
        return this_round(store, table, self.run_id, self.round)


def skipped(name: str, round: int | None) -> dict:
    return {"stage": name, "round": round, "skipped": "already landed"}


def token_counts(meter: Meter, ctx: RoundContext, name: str) -> dict[str, pa.Table]:
    """The `generated_tokens` rows of a stage's meter (none when it generated nothing)."""
    rows = [{"run_id": ctx.run_id, "round": ctx.round, "stage": name, **r} for r in meter.rows()]
    return {"generated_tokens": pa.Table.from_pylist(rows)} if rows else {}


def stage(name: str, **task_options: Any) -> Callable[[Callable[..., dict]], Any]:
    """Make `fn(ctx, store, *sections) -> dict` the Prefect task `name` taking `(ctx, *sections)`."""

    def wrap(fn: Callable[..., dict]) -> Any:
        @functools.wraps(fn)
        def run(ctx: RoundContext, *sections: Any, **kwargs: Any) -> dict:
            store = Store(ctx.store)
            if store.landed(ctx.run_id, ctx.round, name):
                return skipped(name, ctx.round)
            claim_threads()  # this process's share of the cores, re-read per stage (models/threads.py)
            try:
                with metering() as meter:  # what the stage generates lands with its commit (models/meter.py)
                    store.riders[(ctx.run_id, ctx.round, name)] = lambda: token_counts(meter, ctx, name)
                    return {"stage": name, "round": ctx.round, **fn(ctx, store, *sections, **kwargs)}
            finally:
                release_embedder()
                release_memory()  # what the stage freed goes back to the OS before the next stage's peak

        # Prefect binds a call's arguments to the task's signature: the stage's own, without `store`
        params = list(inspect.signature(fn).parameters.values())
        run.__signature__ = inspect.Signature([p for p in params if p.name != "store"])
        return task(name=name, **task_options)(timed(run))

    return wrap
