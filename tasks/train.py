"""Train stage: one GRPO round on the round's rollouts (ALGORITHMS.md §6), plus an SFT term on shaped traces.

- Advantages per group: A_i = (r_i - mean r) / (std r + 1e-6) (population std; `scale_std=false` is Dr.GRPO).
  Zero-variance groups carry no gradient: they are counted and never forwarded.
- Policy loss per response token: PPO clip with clip-higher, -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A),
  averaged over every response token of the optimizer step (token-level, DAPO style).
- LoPE-replaced rollouts (tasks/lope.py) were sampled under a perturbed prompt: their old log-probs are taken
  under that prompt, and their ratio is shaped rho / (rho + 0.1) instead of clipped.
- Old log-probs are recomputed with the training model before the first update, so differences between the
  sampling backend and the trainer do not bias the ratio.
- KL to the frozen starting model (policy version 0), k3 estimator exp(ref - logp) - (ref - logp) - 1,
  coefficient `kl_coef` (0 switches it off and skips the reference forward).
- L = L_grpo + lambda_sft * NLL(shaped traces), the NLL averaged over the traces' tokens.
- Full fine-tune or LoRA (peft; merged into a plain checkpoint on save), fp32 or bf16 autocast, gradient
  accumulation over micro-batches, gradient-norm clipping, AdamW. One pass over the round's data.
Each optimizer step lands a `train_steps` row; the round's result is a new checkpoint (policy_version + 1,
parent = the version that collected the round), recorded in `checkpoints` in the same atomic stage.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from typing import Any

import polars as pl
import pyarrow as pa
import torch
import torch.nn.functional as F
from prefect import task

from models.hf import _autocast
from storage.query import scan
from storage.store import Store, fault_point
from tasks.lope import RATIO_FLOOR
from tasks.reporting import progress_reporter, sig4


@dataclass
class Sequence:
    """One training sequence: prompt and completion token ids, its advantage, and for a LoPE-replaced rollout
    the prompt it was actually sampled under."""

    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float = 0.0
    behaviour_ids: list[int] | None = None


def group_advantages(rewards: list[float], scale_std: bool = True, eps: float = 1e-6) -> list[float] | None:
    """(r - mean) / (std + 1e-6) per group, or None for a zero-variance group.

    >>> group_advantages([1.0, 0.0, 0.0, 1.0])
    [0.999998000004, -0.999998000004, -0.999998000004, 0.999998000004]
    >>> group_advantages([0.5, 0.5]) is None, group_advantages([1.0, 0.0], scale_std=False)
    (True, [0.5, -0.5])
    """
    n = len(rewards)
    mean = sum(rewards) / n
    std = (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5
    if std <= eps:
        return None
    return [(r - mean) / (std + 1e-6) if scale_std else r - mean for r in rewards]


def completion_logprobs(model, prompts: list[list[int]], completions: list[list[int]], pad_id: int,
                        device: str = "cpu", dtype: str = "fp32", entropy: bool = False):
    """Per-token log-probs of each completion given its prompt, right-padded to [B, T], with the mask
    (and, with `entropy`, each position's full-distribution entropy, without gradient). The output layer
    runs only on completion positions, so [B, L, vocab] logits never exist."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder, head = base.get_decoder(), base.get_output_embeddings()
    seqs = [p + c for p, c in zip(prompts, completions)]
    width = max(len(s) for s in seqs)
    t_max = max(len(c) for c in completions)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    pos = torch.zeros((len(seqs), t_max), dtype=torch.long)
    tgt = torch.zeros((len(seqs), t_max), dtype=torch.long)
    mask = torch.zeros((len(seqs), t_max))
    for r, (p, c) in enumerate(zip(prompts, completions)):
        ids[r, : len(p) + len(c)] = torch.tensor(p + c)
        attn[r, : len(p) + len(c)] = 1
        pos[r, : len(c)] = torch.arange(len(p) - 1, len(p) + len(c) - 1)
        tgt[r, : len(c)] = torch.tensor(c)
        mask[r, : len(c)] = 1
    with _autocast(device, dtype):
        hidden = decoder(input_ids=ids.to(device), attention_mask=attn.to(device)).last_hidden_state
    h = hidden.gather(1, pos.to(device)[..., None].expand(-1, -1, hidden.shape[-1]))
    logits = head(h.to(head.weight.dtype)).float()
    logp_all = F.log_softmax(logits, -1)
    logp = logp_all.gather(2, tgt.to(device)[..., None])[..., 0]
    ent = None
    if entropy:
        with torch.no_grad():
            ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, mask.to(device), ent


def grpo_token_terms(logp, old_logp, ref_logp, adv, mask, lope, eps_low: float = 0.2, eps_high: float = 0.28,
                     kl_coef: float = 0.01) -> dict:
    """Masked *sums* over tokens of the GRPO terms, so micro-batches can be accumulated and divided by the
    optimizer step's token count. Shapes: [B, T] for log-probs and mask, [B] for adv and lope (bool).
    Returns loss (pg + kl_coef * kl), pg, kl and clipped (token counts where the clip is active)."""
    ratio = torch.exp(logp - old_logp)
    a = adv[:, None]
    unclipped = ratio * a
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a
    pg = -torch.minimum(unclipped, clipped)
    lope = lope[:, None].expand_as(pg)
    pg = torch.where(lope, -(ratio / (ratio + RATIO_FLOOR)) * a, pg)
    if ref_logp is not None and kl_coef > 0:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1
    else:
        kl = torch.zeros_like(logp)
    clip_active = (clipped < unclipped) & ~lope  # the min picked the clipped branch: no gradient through rho
    return {"loss": ((pg + kl_coef * kl) * mask).sum(), "pg": (pg * mask).sum(), "kl": (kl * mask).sum(),
            "clipped": (clip_active.float() * mask).sum()}


def _pad(rows: list[torch.Tensor], t: int, device: str) -> torch.Tensor:
    out = torch.zeros((len(rows), t))
    for r, x in enumerate(rows):
        out[r, : len(x)] = x
    return out.to(device)


@torch.no_grad()
def _logprobs(model, prompts, comps, pad_id, device, dtype, micro: int) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for k in range(0, len(prompts), micro):
        lp, mask, _ = completion_logprobs(model, prompts[k : k + micro], comps[k : k + micro], pad_id, device, dtype)
        out += [lp[r, : int(mask[r].sum())].cpu() for r in range(lp.shape[0])]
    return out


def train_round(model, ref_model, seqs: list[Sequence], sft: list[Sequence], cfg: Any, pad_id: int,
                device: str = "cpu", dtype: str = "fp32", seed: int = 0, on_step=None) -> list[dict]:
    """One pass of GRPO (+ SFT) over `seqs` (and `sft`), `cfg.rows_per_step` sequences per optimizer step.
    Returns a stats row per step. The model is updated in place."""
    if not seqs and not (sft and cfg.sft_weight > 0):
        return []
    torch.manual_seed(seed)
    rng = random.Random(seed)
    micro = cfg.micro_batch
    model.eval()
    old = _logprobs(model, [s.behaviour_ids or s.prompt_ids for s in seqs], [s.completion_ids for s in seqs],
                    pad_id, device, dtype, micro)
    ref = (_logprobs(ref_model, [s.prompt_ids for s in seqs], [s.completion_ids for s in seqs], pad_id, device,
                     dtype, micro) if ref_model is not None and cfg.kl_coef > 0 else None)
    order = list(range(len(seqs)))
    rng.shuffle(order)
    n_steps = max(1, -(-len(seqs) // cfg.rows_per_step))
    sft_order = list(range(len(sft))) if cfg.sft_weight > 0 else []
    rng.shuffle(sft_order)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.999), weight_decay=cfg.weight_decay)
    model.train()
    rows = []
    for step in range(n_steps):
        t0 = time.perf_counter()
        chunk = order[step * cfg.rows_per_step : (step + 1) * cfg.rows_per_step]
        sft_chunk = sft_order[step::n_steps]
        opt.zero_grad(set_to_none=True)
        tokens = sum(len(seqs[i].completion_ids) for i in chunk)
        sums = {"loss": 0.0, "pg": 0.0, "kl": 0.0, "clipped": 0.0, "entropy": 0.0}
        for k in range(0, len(chunk), micro):
            batch = [seqs[i] for i in chunk[k : k + micro]]
            idx = chunk[k : k + micro]
            logp, mask, ent = completion_logprobs(model, [s.prompt_ids for s in batch],
                                                  [s.completion_ids for s in batch], pad_id, device, dtype, True)
            t = logp.shape[1]
            terms = grpo_token_terms(
                logp, _pad([old[i] for i in idx], t, device), _pad([ref[i] for i in idx], t, device) if ref else None,
                torch.tensor([s.advantage for s in batch], device=device), mask,
                torch.tensor([s.behaviour_ids is not None for s in batch], device=device),
                cfg.eps_low, cfg.eps_high, cfg.kl_coef)
            (terms["loss"] / tokens).backward()
            for key in ("loss", "pg", "kl", "clipped"):
                sums[key] += float(terms[key].detach())
            sums["entropy"] += float((ent * mask).sum())
        sft_loss = None
        if sft_chunk:
            sft_tokens = sum(len(sft[i].completion_ids) for i in sft_chunk)
            nll = 0.0
            for k in range(0, len(sft_chunk), micro):
                batch = [sft[i] for i in sft_chunk[k : k + micro]]
                logp, mask, _ = completion_logprobs(model, [s.prompt_ids for s in batch],
                                                    [s.completion_ids for s in batch], pad_id, device, dtype)
                part = -(logp * mask).sum()
                (cfg.sft_weight * part / sft_tokens).backward()
                nll += float(part)
            sft_loss = nll / sft_tokens
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
        opt.step()
        denom = max(tokens, 1)
        pg_loss = sums["pg"] / denom if tokens else 0.0
        loss = sums["loss"] / denom + (cfg.sft_weight * sft_loss if sft_loss is not None else 0.0)
        rows.append({"step": step, "loss": loss, "pg_loss": pg_loss, "sft_loss": sft_loss,
                     "kl": sums["kl"] / denom if tokens else None,
                     "entropy": sums["entropy"] / denom if tokens else None, "grad_norm": grad_norm,
                     "clip_frac": sums["clipped"] / denom if tokens else None,
                     "n_tokens": tokens + sum(len(sft[i].completion_ids) for i in sft_chunk),
                     "seconds": time.perf_counter() - t0})
        if on_step:
            on_step(rows[-1])
    model.eval()
    return rows


def rollout_sequences(rollouts: pl.DataFrame, tokenizer, eos_id: int, scale_std: bool,
                      max_completion_tokens: int) -> tuple[list[Sequence], int, int]:
    """Training sequences from one round's rollouts: (sequences, groups used, zero-variance groups skipped)."""
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
            seqs.append(Sequence(prompt_ids, comp, a, behaviour))
    return seqs, used, skipped


def load_trainable(path: str, cfg: Any, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if cfg.mode == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                 "gate_proj", "up_proj", "down_proj"]))
    return model, tokenizer


def train(store: Store, run_id: str, round: int, policy_version: int, policy: str, base: str, cfg: Any,
          model_cfg: Any, rollout_cfg: Any) -> dict:
    """The train stage of (run_id, round): GRPO on the round's rollouts + SFT on its shaped traces, then a new
    checkpoint. `policy` sampled the round (version `policy_version`); `base` (version 0) is the KL reference."""
    from models.checkpoints import save_checkpoint
    from models.registry import release_backends, resolve

    if store.landed(run_id, round, "train"):
        return {"stage": "train", "round": round, "skipped": "already landed"}
    this = (pl.col("run_id") == run_id) & (pl.col("round") == round)
    rollouts = scan(store, "rollouts").filter(this).select(
        "prompt_id", "sample_idx", "prompt_text", "completion", "reward", "finish_reason", "augmentation").collect()
    shaped = scan(store, "shaped_traces").filter(this & pl.col("correct")).select("prompt_id", "text").collect()
    device = model_cfg.device
    path = resolve(policy)
    release_backends()  # the sampling backends' weights are not needed while training
    model, tokenizer = load_trainable(path, cfg, device)
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    seqs, used, skipped = rollout_sequences(rollouts, tokenizer, eos_id, cfg.scale_std, rollout_cfg.max_new_tokens)
    sft: list[Sequence] = []
    if shaped.height and cfg.sft_weight > 0:
        prompts = scan(store, "prompts").select("prompt_id", "text").unique("prompt_id").collect()
        questions = dict(prompts.iter_rows())
        for p, text in shaped.iter_rows():
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": f"{questions[p]}\n{rollout_cfg.instruction}".strip()}],
                tokenize=False, add_generation_prompt=True)
            comp = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos_id]
            sft.append(Sequence(tokenizer(rendered, add_special_tokens=False)["input_ids"], comp))
    ref_model = None
    if cfg.kl_coef > 0 and seqs:
        from transformers import AutoModelForCausalLM

        ref_model = AutoModelForCausalLM.from_pretrained(resolve(base), dtype=torch.float32).to(device).eval()
        ref_model.requires_grad_(False)
    n_steps = max(1, -(-len(seqs) // cfg.rows_per_step)) if (seqs or sft) else 0
    t0 = time.perf_counter()
    with progress_reporter(f"round {round}: training", n_steps) as advance:
        def on_step(row: dict) -> None:
            advance(1)
            fault_point("train:mid")  # test hook: a fault test kills the process here, mid-training

        steps = train_round(model, ref_model, seqs, sft, cfg, pad_id, device, model_cfg.dtype,
                            seed=cfg.seed * 1000 + round, on_step=on_step)
    seconds = time.perf_counter() - t0
    version = policy_version + 1
    saved = str(save_checkpoint(model, tokenizer, store, run_id, version)) if steps else path
    from datetime import UTC, datetime

    now = datetime.now(UTC)
    ckpt = [{"run_id": run_id, "policy_version": version, "parent_version": policy_version, "round": round,
             "path": saved, "created_at": now}]
    if policy_version == 0 and round == 0:
        ckpt.insert(0, {"run_id": run_id, "policy_version": 0, "parent_version": None, "round": 0,
                        "path": resolve(base), "created_at": now})
    step_rows = [{"run_id": run_id, "round": round, "policy_version": version, **r} for r in steps]
    tables = {"checkpoints": pa.Table.from_pylist(ckpt)}
    if step_rows:
        tables["train_steps"] = pa.Table.from_pylist(step_rows)
    store.commit("train", tables, run_id=run_id, round=round)
    losses = [r["loss"] for r in steps]
    return {"stage": "train", "round": round, "policy_version": version, "steps": len(steps),
            "sequences": len(seqs), "groups": used, "zero_variance_groups": skipped, "sft_traces": len(sft),
            "tokens": sum(r["n_tokens"] for r in steps), "seconds": sig4(seconds),
            "tokens_per_s": sig4(sum(r["n_tokens"] for r in steps) / max(seconds, 1e-9)),
            "first_loss": sig4(losses[0]) if losses else None, "last_loss": sig4(losses[-1]) if losses else None}


@task(name="train")
def train_task(store_uri: str, run_id: str, round: int, policy_version: int, policy: str, base: str, cfg: Any,
               model_cfg: Any, rollout_cfg: Any) -> dict:
    return train(Store(store_uri), run_id, round, policy_version, policy, base, cfg, model_cfg, rollout_cfg)
