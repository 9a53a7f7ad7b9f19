"""GRPO (docs/algorithms.md §6) on plain torch: the loss, advantages and one training pass. No store, no Prefect,
so a worker that only has torch and transformers (a GPU box, a torchrun rank) can import it; the train stage
(tasks/train.py) feeds it from the store. See tasks/train.py for the method's summary.

Temperature: every log-prob that stands for the sampling distribution (the new and the recomputed old
policy's in the ratio, the reference's in the KL, the behaviour prompt's in LoPE's ratio, and the entropy
reported) is log_softmax(logits / T) at the temperature the rollouts were sampled at, as verl and TRL
compute it (T = 0, greedy, means 1: models.backend.logprob_temperature). `train_round`'s plan (`TrainPlan`,
tasks/core/train_plan.py) requires T, so no caller trains at T = 1 on samples drawn at 0.7 by default. The SFT term on shaped traces stays
at T = 1: it is plain maximum likelihood of traces that MCMC made likely under pi_ref at T = 1, not a
ratio against a sampling distribution.

Shared prefix (TrainConfig.shared_prefix, on by default): every forward pass (the old and reference log-probs,
the training forward and backward, the SFT term) runs each distinct prompt once and its completions over its
KV cache (tasks/core/prefix.py), which equals the unshared forward over prompt + completion to float
tolerance; micro-batches then count a prompt once plus its completions.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field

from models.backend import logprob_temperature
from models.config import Section
from models.memory import release_memory, trim_heap
from models.training.autocast import autocast, no_autocast
from models.training.grad_into import grads_in_place
from models.training.recompute import lean_activations
from tasks.core.lope import RATIO_FLOOR
from tasks.core.passes import batched_logprobs, forward_passes, pad_rows
from tasks.core.replay import replay_weights
from tasks.core.train_plan import TrainPlan

# k3 is unbounded where the policy has pushed a token far below the reference (exp(ref - logp)); one such
# token gave a step KL of 127 and a gradient norm of 1607 in a real run. verl's "low_var_kl" clamps it at 10
# (TrainConfig.kl_clamp).


class TrainConfig(Section):
    """The GRPO round (docs/algorithms.md §6). Each round that trains writes a new policy version."""

    enabled: bool = Field(True, description="train a new policy version every round")
    mode: Literal["full", "lora"] = Field("full", description="full fine-tune, or LoRA adapters (merged on save)")
    keep_checkpoints: Literal["all", "evaluated"] = Field(
        "all", description="all: every round's checkpoint stays on disk; evaluated: after each round, only the "
        "newest two and the evaluated versions (milestones, the run's end, `refinery eval`) stay, the others' "
        "folders are deleted (models/checkpoints.py `prune_checkpoints`: a 135M policy is 0.5 GB per round in fp32)")
    lr: float = Field(1e-5, gt=0.0, le=1.0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="AdamW weight decay")
    eps_low: float = Field(0.2, ge=0.0, le=1.0, description="clip range below 1")
    eps_high: float = Field(0.28, ge=0.0, le=10.0, description="clip range above 1 (clip-higher)")
    kl_coef: float = Field(0.01, ge=0.0, le=10.0, description="k3 KL to the starting model (0: off)")
    kl_clamp: float = Field(10.0, gt=0.0, le=1e6, description="per-token cap on the k3 KL term, which is unbounded "
                            "where the policy pushed a token far below the reference (verl's low_var_kl: 10)")
    sft_weight: float = Field(0.1, ge=0.0, le=100.0, description="lambda_sft: NLL weight of shaped traces")
    scale_std: bool = Field(True, description="divide advantages by the group std (false: Dr.GRPO)")
    rows_per_step: int = Field(64, ge=1, le=1_000_000, description="sequences per optimizer step")
    micro_batch: int = Field(64, ge=1, le=4096, description="sequences per forward/backward at most (gradient "
                             "accumulation fills the step); micro_tokens is the bound that usually binds")
    micro_tokens: int = Field(512, ge=16, le=10_000_000, description="padded tokens per forward/backward at "
                              "most, a prompt its rows share counted once (bounds activation memory; a longer "
                              "single sequence goes alone)")
    shared_prefix: bool = Field(True, description="run each distinct prompt of a forward pass once, packed with "
                                "its completions (tasks/core/prefix.py; same loss and gradients "
                                "to float tolerance); false: every row runs prompt + completion")
    old_logprobs: Literal["auto", "recompute"] = Field(
        "auto", description="auto: a rollout's old log-probs are the ones its sampler reported where the sampler ran "
        "the trainer's own computation (transformers or scripted backend, fp32 weights, no bf16 autocast: the same "
        "numbers to float rounding) and the rollout holds them; recompute: an old pass over every rollout")
    group_steps: bool = Field(True, description="keep a prompt's rows together in one optimizer step "
                              "(prompt-level mini-batches, as verl's), so the training forward runs each prompt "
                              "once per group; false: rows are shuffled across steps, splitting groups")
    lean_activations: bool = Field(True, description="RMSNorms and gated MLPs keep only their inputs for the "
                                   "backward and rerun themselves in it (models/training/recompute.py): less activation "
                                   "memory, the same gradients to float rounding; false: the library's forward")
    grads_in_place: bool = Field(True, description="the embedding and output layer add their weight gradients "
                                 "into .grad in place (models/training/grad_into.py): no vocabulary-sized temporaries at "
                                 "the end of each backward, the same gradients to float rounding; false: autograd's")
    max_grad_norm: float = Field(1.0, gt=0.0, le=1e6, description="gradient clipping by global norm")
    lora_rank: int = Field(16, ge=1, le=1024, description="lora mode: rank of the adapters")
    lora_alpha: int = Field(32, ge=1, le=4096, description="lora mode: adapter scale (alpha / rank)")
    seed: int = Field(0, ge=0, description="round r uses seed * 1000 + r (torch seed, "
                      "micro-batch order)")
    replay_share: float = Field(0.0, ge=0.0, lt=1.0, description="replay: at most this share of a round's "
                                "training rows are informative groups of earlier rounds, trained again under a "
                                "truncated importance weight (tasks/core/replay.py); 0: off (the default until the "
                                "evidence protocol shows it pays)")
    replay_rounds: int = Field(2, ge=1, le=100, description="replay: groups of the last this many rounds qualify")
    replay_weight_cap: float = Field(2.0, gt=0.0, le=100.0, description="replay: c in the per-token weight "
                                     "min(pi_old / mu, c) of a replayed token")


@dataclass
class Sequence:
    """One training sequence: prompt and completion token ids, its advantage, and for a LoPE-replaced rollout
    the prompt it was actually sampled under."""

    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float = 0.0
    behaviour_ids: list[int] | None = None
    sampled_logprobs: list[float] | None = None  # the sampler's log-probs of completion_ids: the old ones, as given
    # a replayed row (tasks/core/replay.py): its behaviour policy's log-probs of completion_ids, at the sampling
    # temperature; its old log-probs then come from this round's old pass and weight it by min(pi_old / mu, c)
    behaviour_logprobs: list[float] | None = None


def grpo_token_terms(logp, old_logp, ref_logp, adv, mask, lope, eps_low: float = 0.2, eps_high: float = 0.28,
                     kl_coef: float = 0.01, kl_clamp: float = 10.0, weight=None) -> dict:
    """Masked *sums* over tokens of the GRPO terms, so micro-batches can be accumulated and divided by the
    optimizer step's token count. Shapes: [B, T] for log-probs, mask and `weight` (a replayed token's truncated
    importance weight, detached; None: all 1), [B] for adv and lope (bool). Returns loss (pg + kl_coef * kl),
    pg, kl and clipped (token counts where the clip is active)."""
    ratio = torch.exp(logp - old_logp)
    a = adv[:, None]
    unclipped = ratio * a
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a
    pg = -torch.minimum(unclipped, clipped)
    lope = lope[:, None].expand_as(pg)
    pg = torch.where(lope, -(ratio / (ratio + RATIO_FLOOR)) * a, pg)
    if weight is not None:
        pg = pg * weight
    if ref_logp is not None and kl_coef > 0:
        d = ref_logp - logp
        kl = torch.clamp(torch.exp(d) - d - 1, max=kl_clamp)
    else:
        kl = torch.zeros_like(logp)
    clip_active = (clipped < unclipped) & ~lope  # the min picked the clipped branch: no gradient through rho
    return {"loss": ((pg + kl_coef * kl) * mask).sum(), "pg": (pg * mask).sum(), "kl": (kl * mask).sum(),
            "clipped": (clip_active.float() * mask).sum()}


def on_policy_or(rows: list[torch.Tensor | None], logp: torch.Tensor, device: str) -> torch.Tensor:
    """`rows` padded to logp's width, a None row taken from `logp` itself, detached (TrainPlan's
    first_step_on_policy)."""
    t = logp.shape[1]
    known = pad_rows([r if r is not None else torch.zeros(0) for r in rows], t, device)
    if all(r is not None for r in rows):
        return known
    now = torch.tensor([r is None for r in rows], device=device)
    return torch.where(now[:, None], logp.detach().to(known.dtype), known)


def _fused_adamw(params: list[torch.nn.Parameter]) -> bool:
    """AdamW's fused kernel (one pass over each parameter, no foreach temporaries: about 6 s less per step for
    SmolLM2-135M on 2 CPU cores) where torch has it for these tensors: fp32/bf16 on CPU or CUDA."""
    return bool(params) and all(p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.bfloat16)
                                for p in params)


def train_round(model: torch.nn.Module, ref_model: torch.nn.Module | Callable[[], torch.nn.Module] | None,
                seqs: list[Sequence], sft: list[Sequence], cfg: TrainConfig, plan: TrainPlan) -> list[dict]:
    """One pass of GRPO (+ SFT) over `seqs` (and `sft`), `cfg.rows_per_step` sequences per optimizer step, run
    as `plan` says (device, dtype, seed, the rows' sampling temperature and the switches that spare forward
    passes: tasks/core/train_plan.py). Returns a stats row per step. The model is updated in place.
    `ref_model` (the KL reference) may be a loader: it is then loaded only when the KL term is on, used for the
    one reference pass before the first step, and released before the optimizer state exists."""
    pad_id, device, dtype, temperature = plan.pad_id, plan.device, plan.dtype, plan.temperature
    logprob_temperature(temperature)  # a bad temperature fails here, before any forward pass
    if not seqs and not (sft and cfg.sft_weight > 0):
        return []
    torch.manual_seed(plan.seed)
    rng = random.Random(plan.seed)
    micro = cfg.micro_batch
    max_tokens = cfg.micro_tokens
    model.eval()
    shared = cfg.shared_prefix
    order = list(range(len(seqs)))
    rng.shuffle(order)
    if cfg.group_steps:  # prompts in the order of their first shuffled row; a prompt's rows next to each other
        first: dict[tuple[int, ...], int] = {}
        for k, i in enumerate(order):
            first.setdefault(tuple(seqs[i].prompt_ids), k)
        order.sort(key=lambda i: first[tuple(seqs[i].prompt_ids)])
    # rows whose old log-probs the first step's forward gives (None below: filled in by on_policy_or)
    current = {i for i in order[: cfg.rows_per_step] if seqs[i].behaviour_ids is None} if plan.first_step_on_policy else set()
    # old log-probs under the prompt each row was sampled with (a LoPE row's behaviour prompt, its own prefix):
    # the sampler's where the row carries them, else an old pass
    old: list[torch.Tensor | None] = [None] * len(seqs)
    for i, s in enumerate(seqs):
        if i not in current and s.sampled_logprobs is not None:
            if len(s.sampled_logprobs) != len(s.completion_ids):
                raise ValueError(f"row {i}: {len(s.sampled_logprobs)} sampled log-probs for "
                                 f"{len(s.completion_ids)} completion tokens")
            old[i] = torch.tensor(s.sampled_logprobs, dtype=torch.float32)
    need = [i for i in range(len(seqs)) if i not in current and old[i] is None]
    if need:
        for i, lp in zip(need, batched_logprobs(model, [seqs[i].behaviour_ids or seqs[i].prompt_ids for i in need],
                                                [seqs[i].completion_ids for i in need], pad_id, device, dtype, micro,
                                                max_tokens, temperature, shared)):
            old[i] = lp
    ref = None
    if plan.reference_is_policy and cfg.kl_coef > 0 and seqs:
        ref = list(old)  # a row of the first step takes the step's own forward, as for its old log-probs
        lope = [i for i, s in enumerate(seqs) if s.behaviour_ids is not None]
        if lope:
            plain = batched_logprobs(model, [seqs[i].prompt_ids for i in lope], [seqs[i].completion_ids for i in lope],
                                     pad_id, device, dtype, micro, max_tokens, temperature, shared)
            for i, lp in zip(lope, plain):
                ref[i] = lp
    elif ref_model is not None and cfg.kl_coef > 0 and seqs:
        reference = ref_model() if callable(ref_model) and not isinstance(ref_model, torch.nn.Module) else ref_model
        ref = batched_logprobs(reference, [s.prompt_ids for s in seqs], [s.completion_ids for s in seqs], pad_id, device,
                        dtype, micro, max_tokens, temperature, shared)
        del reference  # a loaded reference is freed here: it is not needed once its log-probs exist
    n_steps = max(1, -(-len(seqs) // cfg.rows_per_step))
    sft_order = list(range(len(sft))) if cfg.sft_weight > 0 else []
    rng.shuffle(sft_order)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.999), weight_decay=cfg.weight_decay,
                            fused=_fused_adamw(params))
    model.train()
    rows = []
    # less activation memory and no [vocabulary, hidden] gradient temporaries; the same gradients
    with lean_activations(model, cfg.lean_activations), grads_in_place(model, cfg.grads_in_place):
        for step in range(n_steps):
            t0 = time.perf_counter()
            chunk = order[step * cfg.rows_per_step : (step + 1) * cfg.rows_per_step]
            sft_chunk = sft_order[step::n_steps]
            opt.zero_grad(set_to_none=False)  # gradient buffers allocated once, reused every step
            tokens = sum(len(seqs[i].completion_ids) for i in chunk)
            sums = {"loss": 0.0, "pg": 0.0, "kl": 0.0, "clipped": 0.0, "entropy": 0.0}
            passes, logprobs = forward_passes([seqs[i].prompt_ids for i in chunk],
                                              [seqs[i].completion_ids for i in chunk], micro, max_tokens, shared)
            with autocast(device, dtype):  # each weight cast to bf16 once per step, not once per micro-batch
                for part in passes:
                    idx = [chunk[j] for j in part]
                    batch = [seqs[i] for i in idx]
                    logp, mask, ent = logprobs(model, [s.prompt_ids for s in batch], [s.completion_ids for s in batch],
                                               pad_id, device, dtype, True, temperature)
                    # the loss and backward outside autocast; the outer context keeps its cache
                    with no_autocast(device):
                        old_logp = on_policy_or([old[i] for i in idx], logp, device)
                        terms = grpo_token_terms(
                            logp, old_logp,
                            on_policy_or([ref[i] for i in idx], logp, device) if ref else None,
                            torch.tensor([s.advantage for s in batch], device=device), mask,
                            torch.tensor([s.behaviour_ids is not None for s in batch], device=device),
                            cfg.eps_low, cfg.eps_high, cfg.kl_coef, cfg.kl_clamp,
                            replay_weights(batch, old_logp, cfg.replay_weight_cap, device))
                        (terms["loss"] / tokens).backward()
                    trim_heap()  # the pass's freed activations leave; the next pass's do not stack on them
                    for key in ("loss", "pg", "kl", "clipped"):
                        sums[key] += float(terms[key].detach())
                    sums["entropy"] += float((ent * mask).sum())
                sft_loss = None
                if sft_chunk:
                    sft_tokens = sum(len(sft[i].completion_ids) for i in sft_chunk)
                    nll = 0.0
                    passes, logprobs = forward_passes([sft[i].prompt_ids for i in sft_chunk],
                                               [sft[i].completion_ids for i in sft_chunk], micro, max_tokens, shared)
                    for part in passes:
                        batch = [sft[sft_chunk[j]] for j in part]
                        # T = 1 on purpose: maximum likelihood of the shaped traces (see the module docstring)
                        logp, mask, _ = logprobs(model, [s.prompt_ids for s in batch],
                                                 [s.completion_ids for s in batch], pad_id, device, dtype)
                        part = -(logp * mask).sum()
                        with no_autocast(device):
                            (cfg.sft_weight * part / sft_tokens).backward()
                        trim_heap()
                        nll += float(part.detach())
                    sft_loss = nll / sft_tokens
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
            torch.clear_autocast_cache()  # no bf16 copy of a weight outlives its update (a caller's autocast around us)
            opt.step()
            release_memory()  # the step's freed activations back to the OS: the next step's peak does not stack
            denom = max(tokens, 1)
            pg_loss = sums["pg"] / denom if tokens else 0.0
            loss = sums["loss"] / denom + (cfg.sft_weight * sft_loss if sft_loss is not None else 0.0)
            replayed = sum(seqs[i].behaviour_logprobs is not None for i in chunk)
            rows.append({"step": step, "loss": loss, "pg_loss": pg_loss, "sft_loss": sft_loss,
                         "kl": sums["kl"] / denom if tokens else None,
                         "entropy": sums["entropy"] / denom if tokens else None, "grad_norm": grad_norm,
                         "clip_frac": sums["clipped"] / denom if tokens else None,
                         "n_tokens": tokens + sum(len(sft[i].completion_ids) for i in sft_chunk),
                         "seconds": time.perf_counter() - t0,
                         "replay_share": replayed / len(chunk) if chunk and cfg.replay_share > 0 else None})
            if plan.on_step:
                plan.on_step(rows[-1])
    model.eval()
    return rows


