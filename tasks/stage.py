"""The stage contract: what every curriculum stage takes, and the one skeleton all stages share.

A stage is a function `fn(ctx, store, *sections) -> dict` over one round: it reads the store's partitions,
calls the pure algorithms in tasks/core, commits one partition (`store.commit(name, ...)`) and returns a small
summary. `@stage(name)` turns it into the Prefect task the flow calls, as `name_task(ctx, *sections)`:

- it opens the `Store` at `ctx.store`;
- a stage whose commit record already exists returns `{"stage", "round", "skipped": "already landed"}`
  without running (resume is store-driven: docs/architecture.md);
- the summary gains `stage` (the commit's name), `round` and `timing` (the stage's own compute time:
  `tasks.reporting.progress.timed`); keys the stage returns itself win;
- what the stage generates (models/meter.py: rollouts, LoPE resamples, teacher answers, MCMC proposals,
  evaluation samples) is counted and lands as `generated_tokens` rows in the stage's own commit (a rider on
  the store: storage/store.py), so the counts are there exactly when the stage is; a stage killed before
  its commit leaves neither, and its rerun counts what it generates again.

Names known only at run time: `name` is the commit's name, a string (`"collect"`) or a function of the stage's
arguments by keyword (`lambda ctx, **_: f"rescore-v{ctx.policy_version}"`), evaluated before the landed check.
The Prefect task is named by the string, or by the function's own name less `_task` (`rescore_task` is
`rescore`). Two options cover the stages outside a run's rounds: `metered` (a bool, or a function of the
arguments) false keeps their generation out of `generated_tokens`, where the run's token budget and the
comparison's accounting read it (`refinery eval`, rescore); `on_landed` (a function of the arguments) gives
the keys a landed stage's summary says instead of, or beside, `skipped: "already landed"`.

Choices, and why:
- `RoundContext` is a pydantic model, so Prefect records it as a task parameter like any config section
  and the UI shows it; it holds only what names the round (where, which run, which round, which policy), not
  data. Its `model` is the run's model section with `policy` set to the round's policy spec, so a stage
  loads this round's policy with `models.registry.load_model(ctx.model)`.
- Every stage starts by setting torch's threads to this process's share of the machine's cores
  (models/threads.py), so two runs on one machine share its cores instead of oversubscribing them.
- This module knows no feature: a feature whose cache should live only for the stage that loads it registers
  its release with `at_stage_end` (the embedder's MiniLM: tasks/selectors/embed.py), and every stage runs the
  registered releases when it ends, then gives freed memory back (models/memory.py).
- Tests and benchmarks call a stage without Prefect as `name_task.fn(ctx, *sections)`: the same skeleton
  (landed check, summary keys, timing), no task run.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import polars as pl
import pyarrow as pa
from prefect import task
from pydantic import BaseModel, ConfigDict, Field

from models.config import ModelConfig
from models.memory import only_new_objects, release_memory
from models.meter import Meter, metering
from models.sharded import ScaleConfig
from models.threads import claim as claim_threads
from storage.rounds import this_round
from storage.store import Store
from tasks.reporting.progress import timed


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


STAGE_END: list[Callable[[], None]] = []  # what every stage runs when it ends (at_stage_end)


def at_stage_end(release: Callable[[], None]) -> Callable[[], None]:
    """Run `release()` when every stage ends, from now on (a feature's cache that lives for the stage that
    loads it, e.g. tasks/selectors/embed.py's MiniLM); returns `release`, so it decorates."""
    if release not in STAGE_END:
        STAGE_END.append(release)
    return release


def stage(name: str | Callable[..., str], *, metered: bool | Callable[..., bool] = True,
          on_landed: Callable[..., dict] | None = None, **task_options: Any) -> Callable[[Callable[..., dict]], Any]:
    """Make `fn(ctx, store, *sections) -> dict` the Prefect task taking `(ctx, *sections)` that lands commit
    `name` (a string, or a function of the arguments: module docstring)."""

    def wrap(fn: Callable[..., dict]) -> Any:
        # Prefect binds a call's arguments to the task's signature: the stage's own, without `store`
        signature = inspect.Signature([p for p in inspect.signature(fn).parameters.values() if p.name != "store"])

        def of_call(rule: Any, args: tuple, kwargs: dict) -> Any:
            """`rule` itself, or, if it is a function, its value on this call's arguments by keyword."""
            if not callable(rule):
                return rule
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return rule(**bound.arguments)

        @functools.wraps(fn)
        def run(ctx: RoundContext, *sections: Any, **kwargs: Any) -> dict:
            store = Store(ctx.store)
            commit = of_call(name, (ctx, *sections), kwargs)
            if store.landed(ctx.run_id, ctx.round, commit):
                return {**skipped(commit, ctx.round), **of_call(on_landed or {}, (ctx, *sections), kwargs)}
            claim_threads()  # this process's share of the cores, re-read per stage (models/threads.py)
            with only_new_objects():  # the collector's passes inside visit the stage's objects (models/memory.py)
                try:
                    counting = of_call(metered, (ctx, *sections), kwargs)
                    with metering() if counting else nullcontext() as meter:  # lands with the commit (models/meter.py)
                        if meter is not None:
                            store.riders[(ctx.run_id, ctx.round, commit)] = lambda: token_counts(meter, ctx, commit)
                        return {"stage": commit, "round": ctx.round, **fn(ctx, store, *sections, **kwargs)}
                finally:
                    for release in STAGE_END:
                        release()
                    release_memory()  # what the stage freed goes back to the OS before the next stage's peak

        run.__signature__ = signature
        task_name = name if isinstance(name, str) else fn.__name__.removesuffix("_task")
        return task(name=task_name, **task_options)(timed(run))

    return wrap
