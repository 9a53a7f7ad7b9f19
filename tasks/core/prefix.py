"""Shared-prefix log-probs for GRPO (the idea of Prefix Grouper, arXiv 2506.05433): a group's completions share
one prompt, so each distinct prompt of a forward pass is run once and its completions attend to it.

Method, for the rows of one forward pass:
1. rows are grouped by identical prompt token ids (`prompt_groups`); a row whose prompt differs shares with
   nobody, so a LoPE row's behaviour prompt is a prefix of its own in the old-log-prob pass;
2. each group is packed into one sequence, its prompt then its completions back to back with no padding
   between them: [prompt | c1 | c2 | ...]. Positions restart at the prompt's length for every completion, and
   a 4D attention mask lets a prompt token see the prompt before it and a completion token see the prompt
   and its own completion before it (never another completion). Rows of the pass are these packed sequences,
   right-padded to the longest; a pad sees only itself (no query attends to nothing);
3. a completion's first token is predicted from its prompt's last position, the rest from the completion's
   own positions; only those real positions go through the output layer (gathered flat, so padding never
   reaches the [tokens, vocab] logits), then are laid out right-padded as [B, T].
The result equals `tasks.core.passes.completion_logprobs` (the unshared forward over prompt + completion) to
float tolerance; tests/test_prefix.py compares log-probs, losses, gradients and step rows. One dense forward
and backward per pass: no KV cache, no gather of a cache per row, so the backward is the plain one.
The mask is boolean for SDPA and additive (0 / dtype min) for eager attention, the form each one takes as-is.

`shared_micro_batches` packs rows into forward passes: a pass costs (packed sequences x the longest packed
sequence) tokens, at most `max_tokens`, and holds at most `max_rows` completions; a group too large for one
pass is split into as few parts as fit (each part carries its prompt again), its completions then spread evenly
over the parts (`balanced`): a pass's activation memory follows its longest sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.backend import logprob_temperature
from models.training.autocast import autocast, no_autocast

ENTROPY_SLICE = 64  # positions per slice of the entropy's [positions, vocab] temporaries (no gradient)


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
    `max_tokens` tokens each, a pass costing (packed sequences x its longest packed sequence), a packed sequence
    being one prompt and its completions in the pass (a longer single row goes alone).

    >>> shared_micro_batches([[1] * 50, [1] * 50, [2] * 10, [1] * 50], [5, 7, 3, 6], max_rows=8, max_tokens=200)
    [[2, 0, 3, 1]]
    >>> shared_micro_batches([[1] * 50, [1] * 50, [2] * 10, [1] * 50], [5, 7, 3, 6], max_rows=2, max_tokens=100)
    [[2], [1], [0, 3]]
    """
    pieces: list[list[int]] = []
    for group in prompt_groups(prompts):
        width = len(prompts[group[0]])
        split: list[list[int]] = [[]]
        for i in sorted(group, key=lambda i: completion_lengths[i]):
            if split[-1] and (len(split[-1]) >= max_rows or width + completion_lengths[i] > max_tokens):
                split.append([])
                width = len(prompts[group[0]])
            split[-1].append(i)
            width += completion_lengths[i]
        pieces += balanced(split, len(prompts[group[0]]), completion_lengths, max_rows, max_tokens)

    def packed(pc: list[int]) -> int:
        return len(prompts[pc[0]]) + sum(completion_lengths[i] for i in pc)

    pieces.sort(key=packed)
    out: list[list[int]] = []
    n_seqs = widest = 0
    for pc in pieces:
        if out:
            rows = len(out[-1]) + len(pc)
            if rows <= max_rows and (n_seqs + 1) * max(widest, packed(pc)) <= max_tokens:
                out[-1] += pc
                n_seqs, widest = n_seqs + 1, max(widest, packed(pc))
                continue
        out.append(list(pc))
        n_seqs, widest = 1, packed(pc)
    return out


def balanced(split: list[list[int]], prompt_length: int, completion_lengths: list[int], max_rows: int,
             max_tokens: int) -> list[list[int]]:
    """The same rows in as many pieces as `split`, spread so the longest packed piece is as short as a greedy
    spread makes it (longest completion first, into the piece with the fewest tokens that has room): a pass's
    activation memory follows its longest sequence, and the split's pieces cost the same compute either way
    (each carries the prompt once). `split` itself where the spread does not fit the limits.

    >>> balanced([[0, 1, 2], [3]], 10, [4, 4, 4, 4], max_rows=3, max_tokens=30)
    [[0, 2], [1, 3]]
    """
    if len(split) < 2:
        return split
    out: list[list[int]] = [[] for _ in split]
    width = [prompt_length] * len(split)
    for i in sorted((i for piece in split for i in piece), key=lambda i: (-completion_lengths[i], i)):
        room = [k for k in range(len(out)) if len(out[k]) < max_rows and width[k] + completion_lengths[i] <= max_tokens]
        if not room:
            return split
        k = min(room, key=lambda k: (width[k], k))
        out[k].append(i)
        width[k] += completion_lengths[i]
    return [sorted(piece) for piece in out]


def shared_completion_logprobs(model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]],
                               pad_id: int, device: str = "cpu", dtype: str = "fp32", entropy: bool = False,
                               temperature: float = 1.0):
    """`tasks.core.passes.completion_logprobs` with each distinct prompt run once: per-token log-probs of each
    completion, log_softmax(logits / temperature) gathered, right-padded to [B, T], with the mask (and, with
    `entropy`, each position's entropy, without gradient). Every prompt needs at least one token."""
    temperature = logprob_temperature(temperature)
    if any(not p for p in prompts):
        raise ValueError("shared-prefix log-probs need a non-empty prompt for every row")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder, head = base.get_decoder(), base.get_output_embeddings()
    groups = prompt_groups(prompts)
    width = max(len(prompts[g[0]]) + sum(len(completions[i]) for i in g) for g in groups)
    ids = torch.full((len(groups), width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(groups), width), dtype=torch.long)
    segment = torch.full((len(groups), width), -1, dtype=torch.long)  # 0: prompt, k: the k-th completion, -1: pad
    t_max = max(len(c) for c in completions)
    src_seq = torch.zeros((len(completions), t_max), dtype=torch.long)  # where each target's state is
    src_pos = torch.zeros((len(completions), t_max), dtype=torch.long)
    tgt = torch.zeros((len(completions), t_max), dtype=torch.long)
    mask = torch.zeros((len(completions), t_max))
    for k, g in enumerate(groups):
        p = prompts[g[0]]
        ids[k, : len(p)], pos[k, : len(p)], segment[k, : len(p)] = torch.tensor(p), torch.arange(len(p)), 0
        at = len(p)
        for j, r in enumerate(g, start=1):
            c = completions[r]
            ids[k, at : at + len(c)] = torch.tensor(c)
            pos[k, at : at + len(c)] = torch.arange(len(p), len(p) + len(c))
            segment[k, at : at + len(c)] = j
            src_seq[r, : len(c)] = k
            src_pos[r, : len(c)] = torch.tensor([len(p) - 1, *range(at, at + len(c) - 1)])
            tgt[r, : len(c)], mask[r, : len(c)] = torch.tensor(c), 1
            at += len(c)
    seg_q, seg_k = segment[:, :, None], segment[:, None, :]
    order = torch.arange(width)
    allowed = (((seg_k == 0) | (seg_k == seg_q)) & (seg_k >= 0) & (order[None, :] <= order[:, None])) | (
        order[None, :] == order[:, None])  # [G, L, L]; a pad sees itself only
    attn = packed_attention_mask(allowed[:, None], decoder)
    with autocast(device, dtype):
        hidden = decoder(input_ids=ids.to(device), attention_mask=attn.to(device),
                         position_ids=pos.to(device), use_cache=False).last_hidden_state
    real = mask.bool()
    h = hidden[src_seq[real].to(hidden.device), src_pos[real].to(hidden.device)]  # [tokens, d]: no padding
    flat_logp, flat_ent = token_logprobs(head, h[None], tgt[real][None], temperature, entropy)
    logp = torch.zeros((len(completions), t_max), device=h.device, dtype=flat_logp.dtype)
    logp = logp.masked_scatter(real.to(h.device), flat_logp[0])
    ent = None
    if flat_ent is not None:
        ent = torch.zeros_like(logp).masked_scatter(real.to(h.device), flat_ent[0])
    return logp, mask.to(device), ent


def packed_attention_mask(allowed: torch.Tensor, decoder: torch.nn.Module) -> torch.Tensor:
    """The [B, 1, L, L] mask in the form the decoder's attention takes as-is: boolean (True = attend) for SDPA
    and flex-free kernels that accept it, additive float (0 / dtype min) for eager attention."""
    impl = getattr(decoder.config, "_attn_implementation", "sdpa")
    if impl == "sdpa":
        return allowed
    if impl != "eager":
        raise ValueError(f"shared-prefix passes support sdpa and eager attention, not {impl!r} "
                         "(set train.shared_prefix = false)")
    weights = next(decoder.parameters()).dtype
    return torch.zeros(allowed.shape, dtype=weights).masked_fill(~allowed, torch.finfo(weights).min)


def token_logprobs(head: torch.nn.Module, h: torch.Tensor, targets: torch.Tensor, temperature: float,
                   entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_softmax(head(h) / temperature) at `targets` ([B, T] from [B, T, d] states; the output layer in its own
    dtype, the softmax in fp32), and, with `entropy`, each position's entropy of that distribution (no grad)."""
    with no_autocast(h.device.type):  # the output layer in its weights' dtype even inside a caller's autocast
        logp_all = F.log_softmax(head(h.to(head.weight.dtype)).float() / temperature, -1)
    logp = logp_all.gather(2, targets.to(h.device)[..., None])[..., 0]
    ent = None
    if entropy:  # in slices of positions: two [tokens, vocab] temporaries at once were a training step's peak
        with torch.no_grad():
            flat = logp_all.reshape(-1, logp_all.shape[-1])
            ent = torch.cat([-(part.exp() * part).sum(-1) for part in flat.split(ENTROPY_SLICE)]).view(logp.shape)
    return logp, ent
