"""Pieces of the transformers backend's decode loop (models/hf.py): keyed sampling and the batch of rows.

- `sample_keyed` draws one token per row by the Gumbel-max trick with uniforms that are a pure function of
  the row's key (seed, sample index, position) and the vocabulary index, so the noise a row draws does not
  depend on which other rows share its batch or in what order they were admitted;
- `DecodeBatch` holds the rows decoding together in one left-padded KV cache, with per-row positions, so
  that rows join (continuous batching) and leave (end of sequence) without changing what any row computes.
"""

from __future__ import annotations

import torch

M32 = 0xFFFFFFFF


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (xorshift-multiply rounds) on int64 tensors holding values below 2**32; the
    multipliers stay below 2**31, so no product overflows int64."""
    x = x & M32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & M32
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & M32
    return x ^ (x >> 16)


def sample_keyed(logits: torch.Tensor, temperature: float, keys: torch.Tensor) -> torch.Tensor:
    """One token per row by the Gumbel-max trick, with uniforms that are a pure function of the row's key
    (seed, sample, position) and the vocabulary index: exact samples from softmax(logits / T)."""
    if temperature == 0:
        return logits.argmax(-1).cpu()
    vocab = torch.arange(logits.shape[-1], dtype=torch.int64)
    k = hash32(hash32(hash32(keys[:, 0:1]) ^ keys[:, 1:2]) ^ keys[:, 2:3])  # [B, 1]
    u = (hash32(k * 0x9E37 + vocab[None, :]).double() + 0.5) / 2**32
    gumbel = -torch.log(-torch.log(u)).float()
    return (logits.float().cpu() / temperature + gumbel).argmax(-1)


class DecodeBatch:
    """The rows decoding together: their KV cache, attention mask, next positions and pending logits.

    Rows of different lengths share one left-padded cache; padding is masked out, and RoPE positions are
    per row (`next_pos`), so merging and dropping rows never changes what any row computes.
    """

    def __init__(self):
        self.cache = None
        self.rows: list[tuple[int, int]] = []
        self.mask = self.next_pos = self.logits = self.last = None

    @property
    def size(self) -> int:
        return len(self.rows)

    def merge(self, new: DecodeBatch, rows: list[tuple[int, int]]) -> None:
        if self.cache is None or not self.rows:
            self.cache, self.mask, self.next_pos, self.logits = new.cache, new.mask, new.next_pos, new.logits
            self.rows = list(rows)
            return
        width = max(self.mask.shape[1], new.mask.shape[1])
        for old_layer, new_layer in zip(self.cache.layers, new.cache.layers):
            old_layer.keys, new_layer_keys = left_pad(old_layer.keys, width, 2), left_pad(new_layer.keys, width, 2)
            old_layer.values = left_pad(old_layer.values, width, 2)
            old_layer.keys = torch.cat([old_layer.keys, new_layer_keys])
            old_layer.values = torch.cat([old_layer.values, left_pad(new_layer.values, width, 2)])
        self.mask = torch.cat([left_pad(self.mask, width, 1), left_pad(new.mask, width, 1)])
        self.next_pos = torch.cat([self.next_pos, new.next_pos])
        self.logits = torch.cat([self.logits, new.logits])
        self.rows += rows
        self.last = None

    def select(self, keep: list[int], sampled: torch.Tensor) -> None:
        """Keep the rows `keep` (finished ones leave the batch and its cache); append their sampled token."""
        idx = torch.tensor(keep, dtype=torch.long)
        if len(keep) < len(self.rows):
            if keep:
                self.cache.batch_select_indices(idx.to(self.cache.layers[0].keys.device))
            self.mask, self.next_pos = self.mask[idx], self.next_pos[idx]
            self.rows = [self.rows[k] for k in keep]
        self.last = sampled[idx]
        if not keep:
            self.cache = None
            return
        self.mask = torch.cat([self.mask, torch.ones(len(keep), 1, dtype=self.mask.dtype)], dim=1)
        lead = int((self.mask.sum(0) == 0).cumprod(0).sum())  # columns no remaining row uses any more
        if lead:
            self.mask = self.mask[:, lead:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]


def left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`t` with zeros prepended along `dim` up to `width` (unchanged when it is as wide already)."""
    short = width - t.shape[dim]
    if short <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = short
    return torch.cat([torch.zeros(shape, dtype=t.dtype, device=t.device), t], dim=dim)


def cache_kwarg(model: torch.nn.Module) -> str:
    """The keyword a model's forward takes its KV cache by: `cache` in transformers 5.20 and later,
    `past_key_values` before (the gpu extra pins transformers < 5.20 for vLLM). Passing the wrong one is not an
    error there: it lands in **kwargs, the cache is never filled, and each decode step sees only its last
    token, so the keyword is read from the signature rather than assumed."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"
