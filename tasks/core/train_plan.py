"""How one GRPO training pass runs, as opposed to what it optimizes (that is `TrainConfig`, tasks/core/grpo.py).

`train_round(model, ref_model, seqs, sft, cfg, plan)` takes the optimization config and this plan: where the
pass runs (device, dtype, the tokenizer's pad id), its seed and progress callback, the temperature the rows were
sampled at, and two switches that spare forward passes without changing the loss. Before the plan these were
eight loose parameters of train_round, beside a docstring explaining the switches; the switches are explained
once here, on their fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainPlan:
    """One train_round call's plan. `temperature` has no default on purpose: the ratio, KL, LoPE ratio and
    entropy use log_softmax(logits / T) at the temperature the rows were sampled at, and no caller should train
    at T = 1 on samples drawn at 0.7 by default."""

    temperature: float  # the rollouts' sampling temperature (0, greedy, means 1: models.backend.logprob_temperature)
    pad_id: int  # the tokenizer's pad token, for right-padded micro-batches
    device: str = "cpu"
    dtype: str = "fp32"  # 'fp32', 'bf16' or 'auto': autocast of the forward passes (models/training/autocast.py)
    seed: int = 0  # torch seed and the row shuffle's
    on_step: Callable[[dict], None] | None = None  # called with each optimizer step's stats row
    # The KL reference is the model as it starts (round 0, where the policy is the base): `ref_model` is
    # ignored and no reference is loaded. A row sampled under its own prompt takes its reference log-probs
    # from the old pass, which ran the same weights over the same tokens; only LoPE rows, whose old pass ran
    # their behaviour prompt, get a reference pass of their own (under their plain prompt).
    reference_is_policy: bool = False
    # The first optimizer step's rows take their old log-probs (and, with reference_is_policy, their reference
    # log-probs) from that step's own training forward, detached: no update has happened yet, so the weights
    # are those the old pass would run (its ratio is exactly 1, as on-policy GRPO's first step is). Only LoPE
    # rows, whose old log-probs are under another prompt, still get an old pass. It spares 1/n_steps of the
    # old pass; false: every row gets one (the same loss and gradients to float tolerance:
    # tests/test_grpo_first_step.py).
    first_step_on_policy: bool = True
