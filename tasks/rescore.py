"""Rescore stage: re-probe a finished run's reserve pool with its newest checkpoint (docs/algorithms.md §2).

Originals that stop being informative go to reserve (`utility.next_pool`); a policy that has since improved
may find some of them informative again. This stage samples G completions for every reserve prompt of the
run's last round with the newest checkpoint, scores them (EPS, bucket), and lands both as stage
`rescore-v<version>` of that round: rollouts (augmentation `{"rescore": {...}}`, policy_version = the
checkpoint) and prompt_scores. When the run is extended, round r+1's pool is derived from round r's scores
as usual, so a reserve prompt whose EPS now exceeds tau comes back as active; the others stay in reserve for
a later rescore (the original design also said "retires the rest"; the issue asks only to reactivate, and retiring would
make the next night's rescore with a better checkpoint pointless).

Only a completed run is rescored: its last round has trained and evaluated, so nothing of that round reads
the added rows except the next round's pool and selection, which are meant to.
"""

from __future__ import annotations

import json
import time

import polars as pl
from prefect import task

from models.backend import Sampling
from models.config import ModelConfig
from models.meter import record
from models.sharded import ScaleConfig, load_generator
from storage.checkpoints import newest_checkpoint
from storage.query import scan
from storage.rounds import prompts as prompt_table
from storage.rounds import this_round
from storage.runs import LIVE, run_rows
from storage.store import Store
from tasks.core.eps import eps_scores
from tasks.core.fewshot import fewshot_messages
from tasks.core.rewards import RewardConfig
from tasks.core.seeds import round_seed, row_seeds
from tasks.core.verdicts import verdicts
from tasks.reporting.progress import progress_reporter, sig4, timed
from tasks.sampling.rollouts import RolloutConfig, rollout_table
from tasks.score import UtilityConfig

RESCORE_SEED_OFFSET = 500_000  # rescore samples apart from every round's seeds (seed * 1000 + round)


def check_rescorable(store: Store, run_id: str, under_lock: bool = True) -> None:
    """Raise (one line) unless run `run_id` is in the store and completed. Without the run's lock
    (`under_lock` false: a check before the flow) a live status (`running`, `resumed`) passes: the run may be
    alive (taking the lock then says so) or dead (taking the lock marks it failed), so only the check under the
    lock can name its status."""
    rows = run_rows(store, run_id)
    if rows.height == 0:
        raise ValueError(f"run {run_id!r} is not in the store {store.uri}")
    status = rows["status"][-1]
    if status != "completed" and (under_lock or status not in LIVE):
        raise ValueError(f"run {run_id} is {status}, not completed; resume it (refinery run --run-id {run_id}) "
                         "before rescoring its reserve pool")


def rescore(store: Store, run_id: str, model: ModelConfig, cfg: RolloutConfig, reward: RewardConfig,
            utility: UtilityConfig, scale: ScaleConfig | None = None) -> dict:
    """Rescore run `run_id`'s reserve prompts of its last round with its newest checkpoint (the run's own
    config sections: its model, rollout sampling, reward and EPS settings; `scale` shards the sampling over
    Ray workers, models/sharded.py)."""
    check_rescorable(store, run_id)
    last = scan(store, "pool").filter(pl.col("run_id") == run_id).select(pl.col("round").max()).collect().item()
    version, path = newest_checkpoint(store, run_id, model.policy)
    if version:
        from models.checkpoints import local_copy

        path = local_copy(store, path)
    stage = f"rescore-v{version}"
    head = {"stage": "rescore", "run_id": run_id, "round": last, "policy_version": version}
    if store.landed(run_id, last, stage):
        return {**head, "skipped": f"v{version} already rescored this round's reserve"}
    scored = this_round(store, "prompt_scores", run_id, last).select("prompt_id")
    reserve = (this_round(store, "pool", run_id, last).filter(pl.col("status") == "reserve").select("prompt_id")
               .join(scored, on="prompt_id", how="anti"))
    prompts = (reserve.join(prompt_table(store, "text", "answer", "source", "meta"), on="prompt_id")
               .sort("prompt_id").collect())
    if prompts.height == 0:
        store.commit(stage, {}, run_id=run_id, round=last)  # nothing to do, and recorded as done
        return {**head, "reserve": 0, "reactivated": 0, "buckets": {}}
    backend = load_generator(model.model_copy(update={"policy": path}), scale)
    messages, _ = fewshot_messages(prompts, pl.DataFrame(), 0, last, 1, 0.0, 0, cfg.instruction)
    rendered = [backend.render(msg) for msg in messages]
    sampling = Sampling(cfg.temperature, cfg.top_p, cfg.max_new_tokens,
                        seed=round_seed(cfg.seed, last) + RESCORE_SEED_OFFSET + 1000 * version)
    t0 = time.perf_counter()
    with progress_reporter(f"rescore v{version}: rollouts", prompts.height * cfg.group_size) as advance:
        groups = record("rescore", backend.generate(rendered, cfg.group_size, sampling, progress=advance,
                                                    row_seeds=row_seeds(sampling.seed, prompts["prompt_id"].to_list())))
    seconds = time.perf_counter() - t0
    aug = json.dumps({"rescore": {"policy_version": version}})
    table = rollout_table(prompts, groups, rendered, [[aug] * len(g) for g in groups],
                          verdicts(prompts, groups, reward), run_id, last, version)
    scores = eps_scores(pl.from_arrow(table).lazy(), utility.beta, utility.tau, utility.eps)
    store.commit(stage, {"rollouts": table, "prompt_scores": scores.to_arrow()}, run_id=run_id, round=last)
    buckets = dict(scores.group_by("bucket").len().iter_rows())
    return {**head, "reserve": prompts.height, "rollouts": table.num_rows, "seconds": sig4(seconds),
            "reactivated": buckets.get("informative", 0), "buckets": buckets,
            "reactivated_ids": scores.filter(pl.col("bucket") == "informative")["prompt_id"].to_list()}


@task(name="rescore")
@timed
def rescore_task(store_uri: str, run_id: str, model: ModelConfig, cfg: RolloutConfig, reward: RewardConfig,
                 utility: UtilityConfig, scale: ScaleConfig | None = None) -> dict:
    return rescore(Store(store_uri), run_id, model, cfg, reward, utility, scale)
