"""Train stage: one GRPO round on the round's rollouts (docs/algorithms.md §6), plus an SFT term on shaped traces.

- Advantages per group: A_i = (r_i - mean r) / (std r + 1e-6) (population std; `scale_std=false` is Dr.GRPO).
  Zero-variance groups carry no gradient: they are counted and never forwarded.
- Policy loss per response token: PPO clip with clip-higher, -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A),
  averaged over every response token of the optimizer step (token-level, DAPO style).
- LoPE-replaced rollouts (tasks/core/lope.py) were sampled under a perturbed prompt: their old log-probs are taken
  under that prompt, and their ratio is shaped rho / (rho + 0.1) instead of clipped.
- A completion is the token ids its sampler drew (`rollouts.token_ids`, end token included); rows without them
  (imports, older stores) encode their text again, which need not give the sampled ids.
- Old log-probs: the sampler's (`rollouts.token_logprobs`) where it ran the trainer's own computation
  (`train.old_logprobs = "auto"`: transformers or scripted backend, fp32; `sampler_computes_as_trainer`), else
  recomputed with the training model before the first update, so differences between the sampling backend
  and the trainer do not bias the ratio; the first step's rows take them from that step's own forward,
  detached (tasks/core/train_plan.py `first_step_on_policy`: the same weights, no extra pass).
- Every log-prob that describes the sampling distribution (new and old policy, the KL reference, LoPE's
  behaviour prompt, the entropy) is log_softmax(logits / T) at the rollouts' temperature `rollout.temperature`
  (T = 0 means 1), as verl and TRL compute it; the SFT term on shaped traces is plain likelihood at T = 1.
- KL to the frozen starting model (policy version 0), k3 estimator exp(ref - logp) - (ref - logp) - 1,
  clamped at `train.kl_clamp` (10) per token as verl does, coefficient `kl_coef` (0 switches it off and skips the reference forward).
  In round 0 the policy is that model: its reference log-probs come from the old pass (LoPE rows get one pass
  under their plain prompt) and no second model is loaded (tasks/core/train_plan.py `reference_is_policy`).
- Replay (`train.replay_share`, off by default): informative groups of the last `replay_rounds` rounds fill up
  to that share of the round's rows, their surrogate weighted per token by min(pi_old / mu, c) against the
  behaviour log-probs they were sampled with (tasks/core/replay.py); `train_steps.replay_share` records it.
- L = L_grpo + lambda_sft * NLL(shaped traces), the NLL averaged over the traces' tokens.
- Full fine-tune or LoRA (peft; merged into a plain checkpoint on save), fp32 or bf16 autocast, gradient
  accumulation over micro-batches, gradient-norm clipping, AdamW. One pass over the round's data.
Each optimizer step lands a `train_steps` row; the round's result is a new checkpoint (policy_version + 1,
parent = the version that collected the round), recorded in `checkpoints` in the same atomic stage.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from datetime import UTC, datetime

import polars as pl
import pyarrow as pa
import torch

from storage.query import table_rows_with_schema
from storage.rounds import prompts
from storage.store import Store, fault_point
from tasks.core.advantages import group_advantages
from tasks.core.fewshot import ask
from tasks.core.grpo import Sequence, TrainConfig, TrainPlan, train_round
from tasks.core.replay import pick_replay, replay_budget
from tasks.core.seeds import round_seed
from tasks.reporting.progress import progress_reporter, sig4
from tasks.sampling.rollouts import RolloutConfig
from tasks.stage import RoundContext, stage


def rollout_sequences(rollouts: pl.DataFrame, tokenizer, eos_id: int, scale_std: bool,
                      max_completion_tokens: int, sampler_logprobs: bool = False) -> tuple[list[Sequence], int, int]:
    """Training sequences from one round's rollouts: (sequences, groups used, zero-variance groups skipped).
    A completion is the token ids its sampler drew (`token_ids`, end token included) where the row holds them,
    else its text encoded again (which may differ: a sampled tokenization need not be the tokenizer's own).
    With `sampler_logprobs`, a row's `token_logprobs` become its old log-probs."""
    seqs: list[Sequence] = []
    used = skipped = 0
    for _, g in rollouts.sort("prompt_id", "sample_idx").group_by("prompt_id", maintain_order=True):
        rows = g.to_dicts()
        adv = group_advantages([r["reward"] for r in rows], scale_std)
        if adv is None:
            skipped += 1
            continue
        used += 1
        prompt_ids = tokenizer(rows[0]["prompt_text"], add_special_tokens=False)["input_ids"]
        for r, a in zip(rows, adv):
            given = None
            if r.get("token_ids") is not None:
                comp = list(r["token_ids"])
                if sampler_logprobs and r.get("token_logprobs") is not None:
                    given = list(r["token_logprobs"])
            else:
                comp = tokenizer(r["completion"], add_special_tokens=False)["input_ids"][:max_completion_tokens]
                if r["finish_reason"] == "stop":
                    comp = comp + [eos_id]
            if not comp:
                continue
            behaviour = None
            aug = json.loads(r["augmentation"]) if r["augmentation"] else {}
            lope = aug.get("lorem_perturb", {})
            if lope.get("replaced") and lope.get("behaviour_prompt"):
                behaviour = tokenizer(lope["behaviour_prompt"], add_special_tokens=False)["input_ids"]
            seqs.append(Sequence(prompt_ids, comp, a, behaviour, given))
    return seqs, used, skipped


def replay_sequences(store: Store, ctx: RoundContext, cfg: TrainConfig, fresh: int, tokenizer, eos_id: int,
                     max_completion_tokens: int) -> list[Sequence]:
    """Informative groups of the run's last `cfg.replay_rounds` rounds, at most `cfg.replay_share` of the round's
    training rows (tasks/core/replay.py), as sequences carrying their behaviour log-probs."""
    if cfg.replay_share <= 0 or ctx.round == 0:
        return []
    cols = ["round", "prompt_id", "sample_idx", "prompt_text", "completion", "reward", "finish_reason",
            "augmentation", "token_ids", "token_logprobs"]
    earlier = pl.concat([table_rows_with_schema(store, "rollouts", cols, ctx.run_id, r)
                         for r in range(max(0, ctx.round - cfg.replay_rounds), ctx.round)])
    picked = pick_replay(earlier, replay_budget(fresh, cfg.replay_share), cfg.seed, ctx.round)
    out: list[Sequence] = []
    for (_,), rows in sorted(picked.group_by("round"), key=lambda kv: -kv[0][0]):  # a group is (round, prompt)
        seqs, _, _ = rollout_sequences(rows, tokenizer, eos_id, cfg.scale_std, max_completion_tokens,
                                       sampler_logprobs=True)
        out += [replace(s, behaviour_logprobs=s.sampled_logprobs, sampled_logprobs=None) for s in seqs]
    return out


def sampler_computes_as_trainer(backend: str, dtype: str, device: str, remote_workers: bool = False) -> bool:
    """Whether the log-probs a rollout's sampler reported are the numbers the trainer's old pass would compute:
    the transformers backend (or the scripted policy, which reports that model's scores) with fp32 weights, as
    the trainer runs without bf16 autocast. The decode loop's kernels differ from the trainer's (oneDNN's packed
    products, a KV cache), by float rounding only (tests/test_grpo_first_step.py measures it). vLLM, bf16
    weights and bf16 autocast compute them otherwise: the old pass recomputes them there. With `remote_workers`
    (collect sharded over Ray workers, which may run on CPUs with native bf16 where "auto" picks bf16) only an
    explicit fp32 counts."""
    from models.devices import bf16_chosen

    if backend not in ("transformers", "scripted"):
        return False
    return dtype == "fp32" if remote_workers else not bf16_chosen(device, dtype)


def load_trainable(path: str, cfg: TrainConfig, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.hf.backend import sdpa_native_gqa

    sdpa_native_gqa(device)

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if cfg.mode == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                 "gate_proj", "up_proj", "down_proj"]))
    return model, tokenizer


@stage("train")
def train_task(ctx: RoundContext, store: Store, cfg: TrainConfig, rollout_cfg: RolloutConfig) -> dict:
    """GRPO on the round's rollouts + SFT on its shaped traces, then a new checkpoint. The round's policy
    (`ctx.policy`, version `ctx.policy_version`) starts the update; the base (`ctx.base`, version 0) is the KL
    reference."""
    from models.checkpoints import save_checkpoint
    from models.registry import recorded_spec, release_backends, resolve
    from storage.checkpoints import newest_checkpoint, recorded_path

    run_id, round, policy_version, base = ctx.run_id, ctx.round, ctx.policy_version, ctx.base
    # read with the table's schema: token_ids / token_logprobs are null in files written before they existed
    rollouts = table_rows_with_schema(store, "rollouts", ["prompt_id", "sample_idx", "prompt_text", "completion",
                                                          "reward", "finish_reason", "augmentation", "token_ids",
                                                          "token_logprobs"], run_id, round)
    shaped = ctx.rows(store, "shaped_traces").filter(pl.col("correct")).select("prompt_id", "text").collect()
    device = ctx.model.device
    path = resolve(ctx.policy)
    release_backends()  # the sampling backends' weights are not needed while training
    model, tokenizer = load_trainable(path, cfg, device)
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    seqs, used, skipped = rollout_sequences(rollouts, tokenizer, eos_id, cfg.scale_std, rollout_cfg.max_new_tokens,
                                            sampler_logprobs=cfg.old_logprobs == "auto" and sampler_computes_as_trainer(
                                                ctx.model.backend, ctx.model.dtype, device, ctx.scale.rollout_workers > 1))
    replayed = replay_sequences(store, ctx, cfg, len(seqs), tokenizer, eos_id, rollout_cfg.max_new_tokens)
    seqs += replayed
    sft: list[Sequence] = []
    if shaped.height and cfg.sft_weight > 0:
        questions = dict(prompts(store, "text").collect().iter_rows())
        for p, text in shaped.iter_rows():
            rendered = tokenizer.apply_chat_template([ask(questions[p], rollout_cfg.instruction)], tokenize=False,
                                                     add_generation_prompt=True)
            comp = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos_id]
            sft.append(Sequence(tokenizer(rendered, add_special_tokens=False)["input_ids"], comp))

    def load_reference() -> torch.nn.Module:  # version 0, loaded for the one reference pass and then released
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(resolve(base), dtype=torch.float32).to(device).eval()
    n_steps = max(1, -(-len(seqs) // cfg.rows_per_step)) if (seqs or sft) else 0
    t0 = time.perf_counter()
    with progress_reporter(f"round {round}: training", n_steps) as advance:
        def on_step(row: dict) -> None:
            advance(1)
            fault_point("train:mid")  # test hook: a fault test kills the process here, mid-training

        plan = TrainPlan(rollout_cfg.temperature, pad_id, device, ctx.model.dtype, seed=round_seed(cfg.seed, round),
                         on_step=on_step, reference_is_policy=policy_version == 0)  # round 0 starts from the base
        steps = train_round(model, load_reference, seqs, sft, cfg, plan)
    seconds = time.perf_counter() - t0
    version = policy_version + 1
    if steps:
        saved = save_checkpoint(model, tokenizer, store, run_id, version)
    else:  # no update: the new version is the round's policy, recorded where that one is recorded
        saved = newest_checkpoint(store, run_id, base, before_round=round)[1] if policy_version else recorded_spec(
            ctx.policy)
    now = datetime.now(UTC)
    ckpt = [{"run_id": run_id, "policy_version": version, "parent_version": policy_version, "round": round,
             "path": recorded_path(store, saved), "created_at": now}]  # store-relative: the store can move
    if policy_version == 0 and round == 0:
        ckpt.insert(0, {"run_id": run_id, "policy_version": 0, "parent_version": None, "round": 0,
                        "path": recorded_spec(base), "created_at": now})
    step_rows = [{"run_id": run_id, "round": round, "policy_version": version, **r} for r in steps]
    tables = {"checkpoints": pa.Table.from_pylist(ckpt)}
    if step_rows:
        tables["train_steps"] = pa.Table.from_pylist(step_rows)
    store.commit("train", tables, run_id=run_id, round=round)
    losses = [r["loss"] for r in steps]
    return {"policy_version": version, "steps": len(steps),
            "sequences": len(seqs), "replayed": len(replayed), "groups": used, "zero_variance_groups": skipped, "sft_traces": len(sft),
            # rows whose old log-probs are their sampler's (no old pass for them)
            "sampler_logprobs": sum(s.sampled_logprobs is not None for s in seqs),
            "tokens": sum(r["n_tokens"] for r in steps), "seconds": sig4(seconds),
            "tokens_per_s": sig4(sum(r["n_tokens"] for r in steps) / max(seconds, 1e-9)),
            "first_loss": sig4(losses[0]) if losses else None, "last_loss": sig4(losses[-1]) if losses else None}
