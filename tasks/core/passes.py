"""Log-prob passes of GRPO (docs/algorithms.md §6): the forward that gives each completion's per-token log-probs
given its prompt, the micro-batches that bound a pass's tokens, and the no-gradient pass over a whole round's
rows (old and reference log-probs). Two forwards compute the same numbers: the unshared one over prompt +
completion per row (`completion_logprobs`, here) and the shared-prefix one that runs each distinct prompt once
(tasks/core/prefix.py); `forward_passes` picks one by `TrainConfig.shared_prefix`. Plain torch.
"""

from __future__ import annotations

import torch

from models.backend import logprob_temperature
from models.training.autocast import autocast
from tasks.core.prefix import shared_completion_logprobs, shared_micro_batches, token_logprobs


def completion_logprobs(model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]], pad_id: int,
                        device: str = "cpu", dtype: str = "fp32", entropy: bool = False, temperature: float = 1.0):
    """Per-token log-probs of each completion given its prompt, log_softmax(logits / temperature) gathered,
    right-padded to [B, T], with the mask (and, with `entropy`, each position's entropy of that same
    distribution, without gradient). Temperature 0 means 1 (greedy samples; no division by zero). The output
    layer runs only on completion positions, so [B, L, vocab] logits never exist."""
    temperature = logprob_temperature(temperature)
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
    with autocast(device, dtype):
        hidden = decoder(input_ids=ids.to(device), attention_mask=attn.to(device)).last_hidden_state
    h = hidden.gather(1, pos.to(device)[..., None].expand(-1, -1, hidden.shape[-1]))
    logp, ent = token_logprobs(head, h, tgt, temperature, entropy)
    return logp, mask.to(device), ent


def pad_rows(rows: list[torch.Tensor], t: int, device: str) -> torch.Tensor:
    out = torch.zeros((len(rows), t))
    for r, x in enumerate(rows):
        out[r, : len(x)] = x
    return out.to(device)


def micro_batches(lengths: list[int], max_rows: int, max_tokens: int) -> list[list[int]]:
    """Indices grouped into forward passes: by length (less padding), at most `max_rows` rows and at most
    `max_tokens` padded tokens each (a longer single row goes alone). Activation memory of a pass grows with
    its padded tokens, so this bounds it: long few-shot or LoPE prompts no longer multiply it.

    >>> micro_batches([10, 300, 20, 40], max_rows=8, max_tokens=100)
    [[0, 2], [3], [1]]
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out: list[list[int]] = []
    for i in order:
        cur = out[-1] if out else None
        if cur is not None and len(cur) < max_rows and (len(cur) + 1) * lengths[i] <= max_tokens:
            cur.append(i)
        else:
            out.append([i])
    return out


def forward_passes(prompts: list[list[int]], comps: list[list[int]], micro: int, max_tokens: int, shared: bool):
    """Forward passes over the rows, and the log-prob function that runs one (shared-prefix or not)."""
    if shared:
        return shared_micro_batches(prompts, [len(c) for c in comps], micro, max_tokens), shared_completion_logprobs
    return micro_batches([len(p) + len(c) for p, c in zip(prompts, comps)], micro, max_tokens), completion_logprobs


@torch.no_grad()
def batched_logprobs(model: torch.nn.Module, prompts, comps, pad_id, device, dtype, micro: int, max_tokens: int,
              temperature: float, shared: bool) -> list[torch.Tensor]:
    out: list[torch.Tensor | None] = [None] * len(prompts)
    passes, logprobs = forward_passes(prompts, comps, micro, max_tokens, shared)
    with autocast(device, dtype):  # one context: each weight is cast to bf16 once for all the passes
        for idx in passes:
            lp, mask, _ = logprobs(model, [prompts[i] for i in idx], [comps[i] for i in idx], pad_id, device,
                                   dtype, temperature=temperature)
            for r, i in enumerate(idx):
                out[i] = lp[r, : int(mask[r].sum())].cpu()
    return out
