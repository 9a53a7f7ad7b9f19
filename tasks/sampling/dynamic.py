"""DAPO dynamic sampling inside the collect stage (the loop itself: tasks/core/dapo.py; docs/algorithms.md §4), for
a selector that `generates` (tasks/selectors/base.py; dapo_filter).

The select stage's draw is generation batch 1; refills come from the rest of the round's candidates in a
seeded uniform order, each refill k sampled with seed + k * DAPO_SEED_STRIDE (fresh noise that no other round's
seed reaches). Refills are sized by the round's over-sampling factor, 1 / last round's informative ratio capped
at 3 (`dapo_factor`, the select stage's too), and the summary records it. The kept groups become the round's
rollouts; every other group generated lands in `discarded_rollouts` with its generation batch and reason, and the refills are added to `selections`, so that
`selections` names every prompt generated for and each has its group in exactly one of the two tables
(`landed`, which screening's loop, tasks/sampling/screening.py, shares).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import polars as pl
import pyarrow as pa

from models.backend import Backend, Completion, Sampling
from storage.store import Store
from tasks.core.dapo import (
    SURPLUS,
    ZERO_VARIANCE,
    Drawn,
    DynamicSample,
    adaptive_oversample,
    draw_order,
    dynamic_sampling,
)
from tasks.core.rewards import RewardConfig, Verdict
from tasks.core.seeds import round_seed
from tasks.sampling.rollouts import RolloutConfig, Sampled, rollout_table, round_prompts, sample
from tasks.select import SelectConfig
from tasks.selectors.dapo_filter import last_informative_ratio
from tasks.stage import RoundContext

DAPO_SEED_STRIDE = 1_000_003  # refill k of a round samples with seed + k * this: fresh noise, no other round's seed


def in_order(frame: pl.DataFrame, ids: list[str]) -> pl.DataFrame:
    """The rows of `frame` for `ids`, in that order."""
    order = pl.DataFrame({"prompt_id": ids, "_order": list(range(len(ids)))}, schema={"prompt_id": pl.String,
                                                                                       "_order": pl.Int64})
    return frame.join(order, on="prompt_id").sort("_order").drop("_order")


@dataclass
class Group:
    """One prompt's generated group, as dynamic sampling and screening hand it to the loop (tasks/core/dapo.py):
    what `rollout_table` needs, and what it cost. `status` is screening's decision (tasks/core/screening.py),
    `screen_tokens` the part of `n_tokens` its screening samples took."""

    messages: list[dict]
    augmentation: str | None
    rendered: str
    completions: list[Completion]
    checked: list[Verdict]
    seconds: float = 0.0
    n_tokens: int = 0
    status: str | None = None
    screen_tokens: int = 0

    @property
    def rewards(self) -> list[float]:
        return [v.reward for v in self.checked]

    @property
    def timeouts(self) -> int:
        return sum(v.timed_out for v in self.checked)


def dapo_factor(store: Store, ctx: RoundContext, select_cfg: SelectConfig) -> float:
    """dapo_filter's over-sampling factor this round: 1 / last round's informative ratio, capped at 3
    (tasks/core/dapo.py `adaptive_oversample`); round 0: `dapo_oversample`. The select stage computes the same."""
    return adaptive_oversample(last_informative_ratio(store, ctx.run_id, ctx.round), select_cfg.dapo_oversample)


def dynamic_round(store: Store, ctx: RoundContext, first: pl.DataFrame, backend: Backend,
                  demos: pl.DataFrame | None, cfg: RolloutConfig, reward_cfg: RewardConfig,
                  select_cfg: SelectConfig, sampling: Sampling) -> tuple[Sampled, dict, dict[str, pa.Table]]:
    """(the kept groups, the summary, the extra tables to land with the rollouts)."""
    candidates = round_prompts(store, ctx.run_id, ctx.round, False, cfg.include_reserve, select_cfg.strata)
    chosen = set(first["prompt_id"].to_list())
    order = draw_order(candidates["prompt_id"].to_list(), round_seed(select_cfg.seed, ctx.round))
    queue = [i for i in order if i in chosen] + [i for i in order if i not in chosen]
    factor = dapo_factor(store, ctx, select_cfg)

    def generate(ids: list[str], k: int) -> list[Group]:
        rows = in_order(candidates, ids)
        label = f"round {ctx.round}: rollouts" + (f" (dapo refill {k})" if k else "")
        got = sample(backend, rows, demos, ctx, cfg, reward_cfg,
                     replace(sampling, seed=sampling.seed + k * DAPO_SEED_STRIDE), label)
        return [Group(got.messages[i], got.augmentation[i], got.rendered[i], got.groups[i], got.checked[i],
                      got.seconds if i == 0 else 0.0, sum(c.n_tokens for c in got.groups[i]))
                for i in range(rows.height)]  # a batch's seconds ride on its first group

    out = dynamic_sampling(queue, select_cfg.batch_size, factor, select_cfg.dapo_max_batches,
                           generate, rewards=lambda g: g.rewards, first_size=len(chosen))
    got, table, extra = landed(ctx, candidates, out, select_cfg.selector,
                               lambda k: f"{select_cfg.selector}: generation batch {k + 1} (refill)")
    gone = out.discarded
    summary = {"batch_size": out.batch, "oversample": factor, "generation_batches": out.batches,
               "groups_generated": out.generated, "kept": len(out.kept), "discarded_groups": len(gone),
               "zero_variance": sum(d.reason == ZERO_VARIANCE for d in gone),
               "surplus": sum(d.reason == SURPLUS for d in gone), "discarded_rollouts": table.num_rows,
               "discarded_tokens": int(sum(table["n_tokens"].to_pylist())), "short": out.short,
               "cap_hit": out.cap_hit, "exhausted": out.exhausted, "max_batches": select_cfg.dapo_max_batches}
    return got, summary, extra


def landed(ctx: RoundContext, candidates: pl.DataFrame, out: DynamicSample[str], selector_name: str,
           refill_reason: Callable[[int], str]) -> tuple[Sampled, pa.Table, dict[str, pa.Table]]:
    """What a dynamic round lands: the kept groups as the round's rollouts (by prompt_id), every other group as
    `discarded_rollouts` rows with its generation batch and reason, and the refills as `selections` rows; and the
    discarded rows' table (for the summary). Every generated group's tokens and seconds count as spent."""
    kept = sorted(out.kept, key=lambda d: d.item)  # the usual order of a round's rollouts: by prompt_id
    gone = out.discarded
    drawn: list[Drawn[str]] = out.kept + out.discarded
    got = Sampled(in_order(candidates, [d.item for d in kept]), [d.group.messages for d in kept],
                  [d.group.augmentation for d in kept], [d.group.rendered for d in kept],
                  [d.group.completions for d in kept], [d.group.checked for d in kept],
                  sum(d.group.seconds for d in drawn), sum(d.group.n_tokens for d in drawn),  # all generated is spent
                  sum(d.group.timeouts for d in gone))
    table = rollout_table(in_order(candidates, [d.item for d in gone]), [d.group.completions for d in gone],
                          [d.group.rendered for d in gone],
                          [[d.group.augmentation] * len(d.group.completions) for d in gone],
                          [d.group.checked for d in gone], ctx.run_id, ctx.round, ctx.policy_version)
    per_row = [(d.gen_batch, d.reason) for d in gone for _ in d.group.completions]
    table = table.append_column("gen_batch", pa.array([b for b, _ in per_row], pa.int32())).append_column(
        "reason", pa.array([r for _, r in per_row], pa.string()))
    refills = [d for d in drawn if d.gen_batch > 0]
    extra = {"discarded_rollouts": table} if table.num_rows else {}
    if refills:
        extra["selections"] = pa.table({
            "run_id": [ctx.run_id] * len(refills), "round": pa.array([ctx.round] * len(refills), pa.int32()),
            "prompt_id": [d.item for d in refills], "selector": [selector_name] * len(refills),
            "reason": [refill_reason(d.gen_batch) for d in refills]})
    return got, table, extra
