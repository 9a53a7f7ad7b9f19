"""Shared-prefix log-probs for GRPO (the idea of Prefix Grouper, arXiv 2506.05433): a group's completions share
one prompt, so each distinct prompt of a forward pass is run once and its completions attend to its KV cache.

Method, for the rows of one forward pass:
1. rows are grouped by identical prompt token ids (`prompt_groups`); a row whose prompt differs shares with
   nobody, so a LoPE row's behaviour prompt is a prefix of its own in the old-log-prob pass;
2. the pass's distinct prompts run as one right-padded batch with a KV cache (`use_cache`; gradients flow
   into it in the training pass);
3. the cache's rows are gathered out to the completions (`batch_select_indices` with each row's prompt index,
   a differentiable gather, so backward sums each completion's gradient into its one prefix);
4. the completions (right-padded) run over that cache with positions continuing from their own prompt's length
   and an attention mask covering their prompt's real tokens and their own completion;
5. a completion's first token is predicted from its prompt's last position, the rest from the completion's
   own positions; only those positions go through the output layer.
The result equals `tasks.core.grpo.completion_logprobs` (the unshared forward over prompt + completion) to
float tolerance, in the same [B, T] layout; tests/test_prefix.py compares losses, gradients and step rows.
Right padding keeps every query with at least one real key (left-padded prompts would leave pad queries
attending to nothing). The cache keyword of the decoder's forward differs by transformers version
(models.decoding.cache_kwarg).

`shared_micro_batches` packs rows into forward passes counting each distinct prompt once: a pass costs
(distinct prompts x longest prompt) + (rows x longest completion) padded tokens, at most `max_tokens`, and at
most `max_rows` completions; a group too large for one pass is split (each part reruns its prompt).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.backend import logprob_temperature
from models.decoding import cache_kwarg
from models.hf import autocast


def prompt_groups(prompts: list[list[int]]) -> list[list[int]]:
    """Row indices grouped by identical prompt, groups and rows in first-appearance order.

    >>> prompt_groups([[1, 2], [3], [1, 2], [1]])
    [[0, 2], [1], [3]]
    """
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(tuple(p), []).append(i)
    return list(groups.values())


def shared_micro_batches(prompts: list[list[int]], completion_lengths: list[int], max_rows: int,
                         max_tokens: int) -> list[list[int]]:
    """Row indices grouped into shared-prefix forward passes: at most `max_rows` completions and at most
    `max_tokens` padded tokens each, a distinct prompt counted once (a longer single row goes alone).

    >>> shared_micro_batches([[1] * 50, [1] * 50, [2] * 10, [1] * 50], [5, 7, 3, 6], max_rows=8, max_tokens=200)
    [[2, 0, 3, 1]]
    >>> shared_micro_batches([[1] * 50, [1] * 50, [2] * 10, [1] * 50], [5, 7, 3, 6], max_rows=2, max_tokens=100)
    [[2], [0, 3], [1]]
    """
    pieces: list[list[int]] = []
    for group in prompt_groups(prompts):
        p = len(prompts[group[0]])
        piece: list[int] = []
        for i in sorted(group, key=lambda i: completion_lengths[i]):
            if piece and (len(piece) >= max_rows or p + (len(piece) + 1) * completion_lengths[i] > max_tokens):
                pieces.append(piece)
                piece = []
            piece.append(i)
        pieces.append(piece)
    pieces.sort(key=lambda pc: (len(prompts[pc[0]]), max(completion_lengths[i] for i in pc)))
    out: list[list[int]] = []
    n_prompts = p_max = t_max = 0
    for pc in pieces:
        p, t = len(prompts[pc[0]]), max(completion_lengths[i] for i in pc)
        if out:
            rows = len(out[-1]) + len(pc)
            cost = (n_prompts + 1) * max(p_max, p) + rows * max(t_max, t)
            if rows <= max_rows and cost <= max_tokens:
                out[-1] += pc
                n_prompts, p_max, t_max = n_prompts + 1, max(p_max, p), max(t_max, t)
                continue
        out.append(list(pc))
        n_prompts, p_max, t_max = 1, p, t
    return out


def shared_completion_logprobs(model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]],
                               pad_id: int, device: str = "cpu", dtype: str = "fp32", entropy: bool = False,
                               temperature: float = 1.0):
    """`tasks.core.grpo.completion_logprobs` with each distinct prompt run once: per-token log-probs of each
    completion, log_softmax(logits / temperature) gathered, right-padded to [B, T], with the mask (and, with
    `entropy`, each position's entropy, without gradient). Every prompt needs at least one token."""
    from transformers import DynamicCache

    temperature = logprob_temperature(temperature)
    if any(not p for p in prompts):
        raise ValueError("shared-prefix log-probs need a non-empty prompt for every row")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder, head = base.get_decoder(), base.get_output_embeddings()
    groups = prompt_groups(prompts)
    lens = torch.tensor([len(prompts[g[0]]) for g in groups])
    pre_ids = torch.full((len(groups), int(lens.max())), pad_id, dtype=torch.long)
    pre_mask = torch.zeros_like(pre_ids)
    row_group = torch.zeros(len(prompts), dtype=torch.long)
    for k, g in enumerate(groups):
        pre_ids[k, : lens[k]] = torch.tensor(prompts[g[0]])
        pre_mask[k, : lens[k]] = 1
        row_group[g] = k
    t_max = max(len(c) for c in completions)
    ids = torch.full((len(completions), t_max), pad_id, dtype=torch.long)
    mask = torch.zeros((len(completions), t_max))
    for r, c in enumerate(completions):
        ids[r, : len(c)] = torch.tensor(c)
        mask[r, : len(c)] = 1
    pos = lens[row_group][:, None] + torch.arange(t_max)[None, :]
    attn = torch.cat([pre_mask[row_group], mask.long()], dim=1)
    cache, key = DynamicCache(), cache_kwarg(decoder)
    with autocast(device, dtype):
        pre = decoder(input_ids=pre_ids.to(device), attention_mask=pre_mask.to(device),
                      position_ids=torch.arange(pre_ids.shape[1])[None].expand_as(pre_ids).to(device),
                      use_cache=True, **{key: cache}).last_hidden_state
        cache.batch_select_indices(row_group.to(device))  # each completion's rows of its prompt's cache
        hidden = decoder(input_ids=ids.to(device), attention_mask=attn.to(device), position_ids=pos.to(device),
                         use_cache=True, **{key: cache}).last_hidden_state
    last = pre[torch.arange(len(groups), device=pre.device), (lens - 1).to(pre.device)][row_group.to(pre.device)]
    h = torch.cat([last[:, None], hidden[:, :-1]], dim=1)  # the states that predict completion tokens 0 .. T-1
    logp, ent = token_logprobs(head, h, ids, temperature, entropy)
    return logp, mask.to(device), ent


def token_logprobs(head: torch.nn.Module, h: torch.Tensor, targets: torch.Tensor, temperature: float,
                   entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_softmax(head(h) / temperature) at `targets` ([B, T] from [B, T, d] states; the output layer in its own
    dtype, the softmax in fp32), and, with `entropy`, each position's entropy of that distribution (no grad)."""
    logp_all = F.log_softmax(head(h.to(head.weight.dtype)).float() / temperature, -1)
    logp = logp_all.gather(2, targets.to(h.device)[..., None])[..., 0]
    ent = None
    if entropy:
        with torch.no_grad():
            ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent
