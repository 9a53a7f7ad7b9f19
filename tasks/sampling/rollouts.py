"""Sampling for the collect stage: the rollout config, the prompts a round collects for, one verified sampling
pass over them (few-shot context as configured: tasks/core/fewshot.py), and the `rollouts` rows.

The collect stage (tasks/collect.py) calls `sample` once, or, with a selector that `generates` (dapo_filter),
batch by batch (tasks/sampling/dynamic.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import polars as pl
import pyarrow as pa
from pydantic import Field

from models.backend import Backend, Completion, Sampling
from models.config import Section
from models.meter import record
from storage.rounds import prompts as prompt_table
from storage.rounds import this_round
from storage.store import Store, fault_point
from tasks.core.fewshot import fewshot_messages
from tasks.core.rewards import RewardConfig, Verdict
from tasks.core.seeds import row_seeds
from tasks.core.verdicts import verdicts
from tasks.reporting.progress import progress_reporter
from tasks.stage import RoundContext


class RolloutConfig(Section):
    """Sampling of the G rollouts per prompt, few-shot context and LoPE rescue (docs/algorithms.md §3)."""

    group_size: int = Field(8, ge=2, le=256, description="G: samples per prompt")
    temperature: float = Field(0.7, ge=0.0, le=2.0, description="sampling temperature of rollouts (0: greedy)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling: keep the smallest token set with "
                         "this much probability (1: off)")
    max_new_tokens: int = Field(64, ge=1, le=8192, description="longest completion, in tokens")
    seed: int = Field(0, ge=0, description="sampling seed; round r uses seed * 1000 + r "
                      "(tasks/core/seeds.py)")
    instruction: str = Field("Put your final answer within \\boxed{}.",
                             description="appended to every question before the chat template")
    fewshot_p0: float = Field(0.5, ge=0.0, le=1.0, description="CBRL: p_t = p0 * (1 - t/T) of few-shot context; "
                              "with max_generated_tokens set, p_t = p0 * (1 - spent/budget)")
    fewshot_k: int = Field(2, ge=0, le=16, description="CBRL: solved sibling demonstrations per prompt (0: off)")
    lope_prefixes: int = Field(0, ge=0, le=64, description="LoPE: Lorem-Ipsum system prefixes per all-fail "
                               "group (0: off, the default, since held-out pass@1 at equal generated tokens was lower "
                               "with it on: docs/evidence.md)")
    lope_samples: int = Field(4, ge=0, le=64, description="LoPE: resamples per prefix")
    lope_max_groups: int = Field(4, ge=0, le=1_000_000, description="LoPE: all-fail groups resampled per round")
    include_reserve: bool = Field(False, description="reserve prompts are candidates too (default: only the "
                                  "rescore flow re-probes them)")


def round_prompts(store: Store, run_id: str, round: int, use_selection: bool, include_reserve: bool) -> pl.DataFrame:
    """The prompts this round collects for: its selection, or (a `whole_pool` selector: 'all') the pool's active
    members, and reserve ones if asked."""
    if use_selection:
        ids = this_round(store, "selections", run_id, round)
    else:
        statuses = ["active", "reserve"] if include_reserve else ["active"]
        ids = this_round(store, "pool", run_id, round).filter(pl.col("status").is_in(statuses))
    # root_id: few-shot context keeps a prompt's own lineage out of its demonstrations
    prompts = prompt_table(store, "text", "answer", "source", "meta", "root_id")
    return ids.select("prompt_id").unique().join(prompts, on="prompt_id", how="inner").sort("prompt_id").collect()


def rollout_table(prompts: pl.DataFrame, groups: list, rendered: list[str], augmentation: list[list[str | None]],
                  checked: list[list], run_id: str, round: int, policy_version: int) -> pa.Table:
    cols: dict[str, list] = {k: [] for k in ("prompt_id", "sample_idx", "prompt_text", "completion", "reward",
                                             "correct", "n_tokens", "mean_logprob", "finish_reason",
                                             "augmentation", "verify_timeout", "token_ids", "token_logprobs")}
    for row, text, augs, group, vs in zip(prompts.iter_rows(named=True), rendered, augmentation, groups, checked):
        for i, (c, aug, v) in enumerate(zip(group, augs, vs)):
            for k, x in (("prompt_id", row["prompt_id"]), ("sample_idx", i), ("prompt_text", text),
                         ("completion", c.text), ("reward", v.reward), ("correct", v.correct),
                         ("n_tokens", c.n_tokens), ("mean_logprob", c.mean_logprob),
                         ("finish_reason", c.finish_reason), ("augmentation", aug),
                         ("verify_timeout", v.timed_out), ("token_ids", c.sampled_ids),
                         ("token_logprobs", c.sampled_logprobs)):
                cols[k].append(x)
    n = len(cols["prompt_id"])
    cols["augmentation"] = pa.array(cols["augmentation"], pa.string())
    cols["token_ids"] = pa.array(cols["token_ids"], pa.list_(pa.int32()))
    cols["token_logprobs"] = pa.array(cols["token_logprobs"], pa.list_(pa.float32()))
    return pa.table({"run_id": [run_id] * n, "round": [round] * n, "policy_version": [policy_version] * n, **cols})


@dataclass
class Sampled:
    """The groups one sampling pass produced, in the order of `prompts`' rows."""

    prompts: pl.DataFrame
    messages: list[list[dict]]  # chat messages per prompt
    augmentation: list[str | None]  # few-shot record per prompt
    rendered: list[str]  # the prompt text the model saw
    groups: list[list[Completion]]
    checked: list[list[Verdict]]
    seconds: float = 0.0
    n_tokens: int = 0
    discarded_timeouts: int = 0  # verifier timeouts in groups generated and not kept (dynamic sampling)

    @property
    def timeouts(self) -> int:
        return sum(v.timed_out for vs in self.checked for v in vs) + self.discarded_timeouts


def sample(backend: Backend, prompts: pl.DataFrame, demos: pl.DataFrame | None, ctx: RoundContext,
           cfg: RolloutConfig, reward_cfg: RewardConfig, sampling: Sampling, label: str) -> Sampled:
    """G completions for each of `prompts` (few-shot context as configured), verified."""
    t0 = time.perf_counter()
    messages, augmentation = fewshot_messages(prompts, demos if demos is not None else pl.DataFrame(), cfg.seed,
                                              ctx.round, ctx.rounds, cfg.fewshot_p0, cfg.fewshot_k, cfg.instruction,
                                              spent=ctx.tokens_spent, budget=ctx.token_budget)
    rendered = [backend.render(m) for m in messages]
    with progress_reporter(label, prompts.height * cfg.group_size) as advance:
        def on_progress(k: int) -> None:
            advance(k)
            fault_point("collect:mid")  # test hook: a fault test kills the process here, mid-collection

        groups = record("rollout", backend.generate(rendered, cfg.group_size, sampling, progress=on_progress,
                                                    row_seeds=row_seeds(sampling.seed, prompts["prompt_id"].to_list())))
    seconds = time.perf_counter() - t0
    return Sampled(prompts, messages, augmentation, rendered, groups, verdicts(prompts, groups, reward_cfg),
                   seconds, sum(c.n_tokens for g in groups for c in g))
