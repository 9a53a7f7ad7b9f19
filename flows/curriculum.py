"""The curriculum flow: R rounds of pool -> select -> collect -> score -> refine over one experience store.

Choices, and why:
- Every stage is a Prefect task that commits one store partition and returns a small summary; large data
  never passes through Prefect results.
- Resume is store-driven: a stage whose commit record exists is skipped, so rerunning a run_id continues at
  the first stage that has not landed, whatever killed it.
- Until training lands, every round samples the same policy (policy_version 0).
- Selection (k-means over prompt embeddings, weighted by last round's EPS) picks each round's batch from
  the active pool; selector 'all' collects the whole pool instead.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from prefect import flow

from flows.config import RunConfig
from storage.store import Store, default_root
from tasks.pool import pool_task
from tasks.refine import refine_task
from tasks.rollout import collect_task
from tasks.runs import mark, stored_config
from tasks.select import select_task
from tasks.utility import score_task

POLICY_VERSION = 0
_RESUMABLE = {"rounds", "run_id", "store"}  # fields a resumed run may change


def new_run_id() -> str:
    return "run-" + datetime.now(UTC).strftime("%Y%m%d-%H%M%S")


def _check_resume(config: RunConfig, previous: dict) -> None:
    now = config.model_dump(mode="json")
    changed = sorted(k for k in set(now) | set(previous) if k not in _RESUMABLE and now.get(k) != previous.get(k))
    if changed:
        raise ValueError(f"run {config.run_id} already exists with a different config (differs in: "
                         f"{', '.join(changed)}); resume it with the same config, or choose a new --run-id")


@flow(name="curriculum")
def curriculum(config: RunConfig) -> dict:
    """Run (or resume) a curriculum run; returns per-stage summaries."""
    config = config.model_copy(update={"run_id": config.run_id or new_run_id(),
                                       "store": config.store or default_root()})
    store = Store(config.store)
    store.cleanup()
    previous = stored_config(store, config.run_id)
    if previous is not None:
        _check_resume(config, previous)
    status = mark(store, config.run_id, "running", config.model_dump(mode="json"))
    stages: list[dict] = []
    t0 = time.perf_counter()
    try:
        for r in range(config.rounds):
            stages.append(pool_task(store.uri, config.run_id, r, config.pool.sources, config.pool.seed))
            selecting = config.select.selector != "all"
            if selecting:
                stages.append(select_task(store.uri, config.run_id, r, config.select, config.model,
                                          config.rollout.include_reserve))
            stages.append(collect_task(store.uri, config.run_id, r, POLICY_VERSION, config.model, config.rollout,
                                       config.reward, selecting, config.rounds))
            u = config.utility
            stages.append(score_task(store.uri, config.run_id, r, u.beta, u.tau, u.eps))
            if config.refine.strategies and r + 1 < config.rounds:  # children of the last round would never run
                stages.append(refine_task(store.uri, config.run_id, r, config.refine, config.model))
    except BaseException:
        mark(store, config.run_id, "failed", config.model_dump(mode="json"))
        raise
    mark(store, config.run_id, "completed", config.model_dump(mode="json"))
    return {"run_id": config.run_id, "store": store.uri, "started_as": status, "stages": stages,
            "seconds": time.perf_counter() - t0}
