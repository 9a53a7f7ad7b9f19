"""DAPO dynamic sampling inside the collect stage (the loop itself: tasks/core/dapo.py; docs/algorithms.md §4), for
a selector that `generates` (tasks/selectors/base.py; dapo_filter).

The select stage's draw is generation batch 1; refills come from the rest of the round's candidates in a
seeded uniform order, each refill k sampled with seed + k * DAPO_SEED_STRIDE (fresh noise that no other round's
seed reaches). The kept groups become the round's rollouts; every other group generated lands in
`discarded_rollouts` with its generation batch and reason, and the refills are added to `selections`, so that
`selections` names every prompt generated for and each has its group in exactly one of the two tables.
"""

from __future__ import annotations

from dataclasses import replace

import polars as pl
import pyarrow as pa

from models.backend import Backend, Sampling
from storage.store import Store
from tasks.core.dapo import SURPLUS, ZERO_VARIANCE, Drawn, draw_order, dynamic_sampling
from tasks.core.rewards import RewardConfig
from tasks.core.seeds import round_seed
from tasks.sampling.rollouts import RolloutConfig, Sampled, rollout_table, round_prompts, sample
from tasks.select import SelectConfig
from tasks.stage import RoundContext

DAPO_SEED_STRIDE = 1_000_003  # refill k of a round samples with seed + k * this: fresh noise, no other round's seed


def in_order(frame: pl.DataFrame, ids: list[str]) -> pl.DataFrame:
    """The rows of `frame` for `ids`, in that order."""
    order = pl.DataFrame({"prompt_id": ids, "_order": list(range(len(ids)))}, schema={"prompt_id": pl.String,
                                                                                       "_order": pl.Int64})
    return frame.join(order, on="prompt_id").sort("_order").drop("_order")


def dynamic_round(store: Store, ctx: RoundContext, first: pl.DataFrame, backend: Backend,
                  demos: pl.DataFrame | None, cfg: RolloutConfig, reward_cfg: RewardConfig,
                  select_cfg: SelectConfig, sampling: Sampling) -> tuple[Sampled, dict, dict[str, pa.Table]]:
    """(the kept groups, the summary, the extra tables to land with the rollouts)."""
    candidates = round_prompts(store, ctx.run_id, ctx.round, False, cfg.include_reserve)
    chosen = set(first["prompt_id"].to_list())
    order = draw_order(candidates["prompt_id"].to_list(), round_seed(select_cfg.seed, ctx.round))
    queue = [i for i in order if i in chosen] + [i for i in order if i not in chosen]

    def generate(ids: list[str], k: int) -> list[Sampled]:
        rows = in_order(candidates, ids)
        label = f"round {ctx.round}: rollouts" + (f" (dapo refill {k})" if k else "")
        got = sample(backend, rows, demos, ctx, cfg, reward_cfg,
                     replace(sampling, seed=sampling.seed + k * DAPO_SEED_STRIDE), label)
        return [Sampled(rows[i], [got.messages[i]], [got.augmentation[i]], [got.rendered[i]], [got.groups[i]],
                        [got.checked[i]], got.seconds if i == 0 else 0.0, sum(c.n_tokens for c in got.groups[i]))
                for i in range(rows.height)]  # one per group; a batch's seconds ride on its first group

    out = dynamic_sampling(queue, select_cfg.batch_size, select_cfg.dapo_oversample, select_cfg.dapo_max_batches,
                           generate, rewards=lambda g: [v.reward for v in g.checked[0]], first_size=len(chosen))
    kept = sorted(out.kept, key=lambda d: d.item)  # the usual order of a round's rollouts: by prompt_id
    gone = out.discarded
    drawn: list[Drawn[Sampled]] = out.kept + out.discarded
    got = Sampled(in_order(candidates, [d.item for d in kept]), [d.group.messages[0] for d in kept],
                  [d.group.augmentation[0] for d in kept], [d.group.rendered[0] for d in kept],
                  [d.group.groups[0] for d in kept], [d.group.checked[0] for d in kept],
                  sum(d.group.seconds for d in drawn), sum(d.group.n_tokens for d in drawn),  # all generated is spent
                  sum(d.group.timeouts for d in gone))
    table = rollout_table(in_order(candidates, [d.item for d in gone]), [d.group.groups[0] for d in gone],
                          [d.group.rendered[0] for d in gone],
                          [[d.group.augmentation[0]] * len(d.group.groups[0]) for d in gone],
                          [d.group.checked[0] for d in gone], ctx.run_id, ctx.round, ctx.policy_version)
    per_row = [(d.gen_batch, d.reason) for d in gone for _ in d.group.groups[0]]
    table = table.append_column("gen_batch", pa.array([b for b, _ in per_row], pa.int32())).append_column(
        "reason", pa.array([r for _, r in per_row], pa.string()))
    refills = [d for d in drawn if d.gen_batch > 0]
    extra = {"discarded_rollouts": table} if table.num_rows else {}
    if refills:
        extra["selections"] = pa.table({
            "run_id": [ctx.run_id] * len(refills), "round": pa.array([ctx.round] * len(refills), pa.int32()),
            "prompt_id": [d.item for d in refills], "selector": [select_cfg.selector] * len(refills),
            "reason": [f"{select_cfg.selector}: generation batch {d.gen_batch + 1} (refill)" for d in refills]})
    summary = {"batch_size": out.batch, "generation_batches": out.batches, "groups_generated": out.generated,
               "kept": len(out.kept), "discarded_groups": len(gone),
               "zero_variance": sum(d.reason == ZERO_VARIANCE for d in gone),
               "surplus": sum(d.reason == SURPLUS for d in gone), "discarded_rollouts": table.num_rows,
               "discarded_tokens": int(sum(table["n_tokens"].to_pylist())), "short": out.short,
               "cap_hit": out.cap_hit, "exhausted": out.exhausted, "max_batches": select_cfg.dapo_max_batches}
    return got, summary, extra
