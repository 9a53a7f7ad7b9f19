"""Sequence states: what the model computed over a token sequence, kept so that a later call that starts from
a prefix of it does not compute that prefix again (the transformers backend's `open_states`,
`extend_states` and `generate_from_states`, models/hf/backend.py; MCMC shaping's chains, tasks/core/mcmc.py).

A `SeqState` holds a sequence's ids, each layer's keys and values ([kv_heads, length, head_dim]: RoPE already
applied at positions 0..length-1) and the final hidden state at every position ([length, hidden], the output
layer's input, so the next-token distribution after any prefix is one output-layer row away). Every prefix of
the sequence is usable: its first `cut` columns are the state of ids[:cut], exactly what a forward over
ids[:cut] alone would compute (causal attention: no position sees a later one), up to the float rounding of
batching differently.

Choices:
- per row, without padding: rows of a call are left-padded into one cache (`left_padded`) and split back
  (`split_rows`), so a state does not depend on what it was batched with;
- hidden states rather than logits: 576 floats a position for SmolLM2 against 49,152;
- states are plain tensors with no link to the model: they describe the weights they were computed with, and
  whoever keeps them drops them when the weights change (a chain lives inside one shaping call).
Memory: keys and values cost what the KV cache does (46 KB a token for SmolLM2-135M in fp32), hidden states
2.3 KB a token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SeqState:
    """The model's keys and values (per layer, [kv_heads, length, head_dim]) and final hidden states ([length,
    hidden]) over `ids`."""

    ids: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    hidden: torch.Tensor

    def __len__(self) -> int:
        return len(self.ids)


def check_cuts(states: list[SeqState | None], cuts: list[int]) -> None:
    """A cut must lie within its state (0 for no state): a one-line error otherwise."""
    if len(cuts) != len(states):
        raise ValueError(f"states: {len(states)} states but {len(cuts)} cut points")
    for r, (s, cut) in enumerate(zip(states, cuts)):
        if not 0 <= cut <= (len(s) if s is not None else 0):
            raise ValueError(f"states: cut {cut} of row {r} is outside its state of {len(s) if s else 0} tokens")


def left_padded(states: list[SeqState | None], cuts: list[int]
                ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Each layer's keys and values of the prefixes states[r][:cuts[r]], right-aligned in one [rows, kv_heads,
    width, head_dim] tensor (padding zeroed: masked columns must hold finite numbers), and their attention
    mask [rows, width]. With width 0 (no prefix anywhere) the layers are empty."""
    width = max(cuts, default=0)
    mask = torch.zeros(len(cuts), width, dtype=torch.long)
    for r, cut in enumerate(cuts):
        mask[r, width - cut:] = 1
    if width == 0:
        return [], mask
    like = next(s for s, cut in zip(states, cuts) if cut)
    k0 = like.keys[0]
    out = []
    for layer in range(len(like.keys)):
        k = k0.new_zeros(len(cuts), k0.shape[0], width, k0.shape[2])
        v = torch.zeros_like(k)
        for r, (s, cut) in enumerate(zip(states, cuts)):
            if cut:
                k[r, :, width - cut:] = s.keys[layer][:, :cut]
                v[r, :, width - cut:] = s.values[layer][:, :cut]
        out.append((k, v))
    return out, mask


def last_hidden(states: list[SeqState | None], cuts: list[int]) -> torch.Tensor:
    """The final hidden state at each prefix's last position ([rows, hidden]): the next-token distribution's
    input. Every cut must be at least 1."""
    return torch.stack([s.hidden[cut - 1] for s, cut in zip(states, cuts)])


def split_rows(states: list[SeqState | None], cuts: list[int], conts: list[list[int]], width: int,
               layer_kv: list[tuple[torch.Tensor, torch.Tensor]], hidden: torch.Tensor) -> list[SeqState]:
    """The states of prefixes + continuations after one forward whose cache holds `width` left-padded prefix
    columns then the right-padded continuations (`layer_kv`: each layer's [rows, kv_heads, width + extra,
    head_dim]), and whose hidden states over the continuations are `hidden` ([rows, extra, hidden]). Each row's
    columns are contiguous: [width - cut, width + len(cont)). Copies, so the batch's tensors can go."""
    out = []
    for r, (s, cut, cont) in enumerate(zip(states, cuts, conts)):
        cols = slice(width - cut, width + len(cont))
        h = hidden[r, : len(cont)]
        out.append(SeqState((s.ids[:cut] if s is not None else []) + list(cont),
                            [k[r, :, cols].clone() for k, _ in layer_kv], [v[r, :, cols].clone() for _, v in layer_kv],
                            torch.cat([s.hidden[:cut], h]) if cut else h.clone()))
    return out
