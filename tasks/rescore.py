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
the added rows except the next round's pool and selection, which are meant to. The flow takes the run's lock,
builds the round's context (`rescore_context`: the last round, the newest checkpoint as its policy) and calls
the stage; a checkpoint whose rescore landed is skipped (the stage contract, tasks/stage.py), and its
generation stays out of the run's `generated_tokens` (the budget of an extended run counts the run's own
rounds only). Sampling is the shared generate-and-verify pass (tasks/sampling/verified.py).
"""

from __future__ import annotations

import json

import polars as pl

from models.config import ModelConfig
from models.sharded import ScaleConfig, load_generator
from storage.checkpoints import newest_checkpoint
from storage.query import scan
from storage.rounds import prompts as prompt_table
from storage.runs import LIVE, run_rows
from storage.store import Store
from tasks.core.eps import eps_scores
from tasks.core.rewards import RewardConfig
from tasks.reporting.progress import sig4
from tasks.sampling.rollouts import RolloutConfig, rollout_table
from tasks.sampling.verified import config_sampling, generate_verified, plain_messages
from tasks.score import UtilityConfig
from tasks.stage import RoundContext, stage

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


def rescore_context(store: Store, run_id: str, model: ModelConfig, scale: ScaleConfig | None = None) -> RoundContext:
    """The round a rescore works in, checked (under the run's lock) that the run completed: the run's last
    round, with its newest checkpoint (a local copy) as the policy; `model` and `scale` are the run's own
    sections (`scale` shards the sampling over Ray workers, models/sharded.py)."""
    check_rescorable(store, run_id)
    last = scan(store, "pool").filter(pl.col("run_id") == run_id).select(pl.col("round").max()).collect().item()
    version, path = newest_checkpoint(store, run_id, model.policy)
    if version:
        from models.checkpoints import local_copy

        path = local_copy(store, path)
    return RoundContext(store=store.uri, run_id=run_id, round=last, policy_version=version, base=model.policy,
                        model=model.model_copy(update={"policy": path}), scale=scale or ScaleConfig())


def rescore_stage(ctx: RoundContext, **_) -> str:
    """The commit of a rescore: `rescore-v<checkpoint>` of the run's last round."""
    return f"rescore-v{ctx.policy_version}"


def already_rescored(ctx: RoundContext, **_) -> dict:
    """A landed rescore's summary (the CLI prints its `skipped`)."""
    return {"stage": "rescore", "run_id": ctx.run_id, "policy_version": ctx.policy_version,
            "skipped": f"v{ctx.policy_version} already rescored this round's reserve"}


# the run's budget and the comparison's accounting leave a rescore's generation out (models/meter.py)
@stage(rescore_stage, metered=False, on_landed=already_rescored)
def rescore_task(ctx: RoundContext, store: Store, cfg: RolloutConfig, reward: RewardConfig,
                 utility: UtilityConfig) -> dict:
    """Rescore the reserve prompts of the run's last round (`rescore_context`) with its newest checkpoint
    (the run's own config sections: rollout sampling, reward and EPS settings)."""
    version, last, stage_name = ctx.policy_version, ctx.round, rescore_stage(ctx)
    head = {"stage": "rescore", "run_id": ctx.run_id, "round": last, "policy_version": version}
    scored = ctx.rows(store, "prompt_scores").select("prompt_id")
    reserve = (ctx.rows(store, "pool").filter(pl.col("status") == "reserve").select("prompt_id")
               .join(scored, on="prompt_id", how="anti"))
    prompts = (reserve.join(prompt_table(store, "text", "answer", "source", "meta"), on="prompt_id")
               .sort("prompt_id").collect())
    if prompts.height == 0:
        store.commit(stage_name, {}, run_id=ctx.run_id, round=last)  # nothing to do, and recorded as done
        return {**head, "reserve": 0, "reactivated": 0, "buckets": {}}
    backend = load_generator(ctx.model, ctx.scale)
    got = generate_verified(backend, prompts, plain_messages(prompts, cfg.instruction), cfg.group_size,
                            config_sampling(cfg, last, offset=RESCORE_SEED_OFFSET + 1000 * version), reward,
                            "rescore", label=f"rescore v{version}: rollouts")
    aug = json.dumps({"rescore": {"policy_version": version}})
    table = rollout_table(prompts, got.groups, got.rendered, [[aug] * len(g) for g in got.groups], got.checked,
                          ctx.run_id, last, version)
    scores = eps_scores(pl.from_arrow(table).lazy(), utility.beta, utility.tau, utility.eps)
    store.commit(stage_name, {"rollouts": table, "prompt_scores": scores.to_arrow()}, run_id=ctx.run_id, round=last)
    buckets = dict(scores.group_by("bucket").len().iter_rows())
    return {**head, "reserve": prompts.height, "rollouts": table.num_rows, "seconds": sig4(got.seconds),
            "reactivated": buckets.get("informative", 0), "buckets": buckets,
            "reactivated_ids": scores.filter(pl.col("bucket") == "informative")["prompt_id"].to_list()}
