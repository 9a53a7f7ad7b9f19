"""Sampling for the collect stage: the rollout config, the prompts a round collects for, one verified sampling
pass over them (few-shot context as configured: tasks/core/fewshot.py), and the `rollouts` rows.

The collect stage (tasks/collect.py) screens then tops up (tasks/sampling/screening.py, the default), or calls
`sample` once (screening off, or a `whole_pool` selector), or, with a selector that `generates` (dapo_filter),
batch by batch (tasks/sampling/dynamic.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import polars as pl
import pyarrow as pa
from pydantic import Field

from models.backend import Backend, Completion, Sampling
from models.config import Section
from storage.rounds import pool_candidates, this_round
from storage.rounds import prompts as prompt_table
from storage.store import Store, fault_point
from tasks.core.fewshot import fewshot_messages
from tasks.core.rewards import RewardConfig, Verdict
from tasks.sampling.verified import generate_verified
from tasks.stage import RoundContext


class RolloutConfig(Section):
    """Sampling of the G rollouts per prompt, screening then top-up (tasks/sampling/screening.py), few-shot context
    and LoPE rescue (docs/algorithms.md §3, §4.2)."""

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
                               "with it on: docs/evidence-v1.md)")
    lope_samples: int = Field(4, ge=0, le=64, description="LoPE: resamples per prefix")
    lope_max_groups: int = Field(4, ge=0, le=1_000_000, description="LoPE: all-fail groups resampled per round")
    include_reserve: bool = Field(False, description="reserve prompts are candidates too (default: only the "
                                  "rescore flow re-probes them)")
    screen_samples: int = Field(2, ge=0, le=255, description="screening: samples per candidate before its group "
                                "is completed to G; a mixed screen, or a unanimous one the pass-rate posterior "
                                "still finds likely informative, is topped up, the rest land in "
                                "discarded_rollouts and free their tokens for more prompts (0, or >= group_size: "
                                "off, G samples at once; not under dapo_filter or `all`; runs stored without "
                                "it resume with 0)")
    screen_topup_threshold: float = Field(0.7, ge=0.0, le=1.0, description="screening: top up a unanimous screen "
                                          "when the posterior's P(the full group is mixed) is at least this")
    screen_max_batches: int = Field(4, ge=1, le=1000, description="screening: generation batches per round at "
                                    "most, the selection included; refills screen further candidates until B "
                                    "groups are kept or this is reached")
    screen_refill: Literal["informative", "stratified"] = Field(
        "informative", description="screening: the order refills screen further candidates in: informative (best "
        "predicted P(mixed group) first) or stratified (that order inside each pass-rate bin, the bins at their "
        "share of the candidates, as a uniform draw has them; tasks/core/screening.py)")
    screen_posterior_topups: int = Field(1_000_000, ge=0, le=1_000_000, description="screening: unanimous "
                                         "screens topped up on the posterior's word per round, at most (mixed "
                                         "ones always are); the budget governor holds it at 1 while those "
                                         "top-ups make fewer training rows per 1k tokens than plain rollouts")

    # a run stored before screening existed sampled G at once: it resumes so (flows/config.py `stored_base`)
    absent_means: ClassVar[dict] = {"screen_samples": 0}


def round_prompts(store: Store, run_id: str, round: int, use_selection: bool, include_reserve: bool,
                  strata: Sequence[str] = ()) -> pl.DataFrame:
    """The prompts this round collects for: its selection, or (a `whole_pool` selector: 'all'; the candidates
    of screening's refills and DAPO's batches) the pool's active members, and reserve ones if asked, of
    `strata` only when it names any (select.strata)."""
    if use_selection:
        ids = this_round(store, "selections", run_id, round)
    else:
        ids = pool_candidates(store, run_id, round, include_reserve, strata)
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
    got = generate_verified(backend, prompts, messages, cfg.group_size, sampling, reward_cfg, "rollout", label,
                            lambda k: fault_point("collect:mid"))  # test hook: a fault test kills the process here
    return Sampled(prompts, messages, augmentation, got.rendered, got.groups, got.checked,
                   time.perf_counter() - t0, got.n_tokens)
