"""Pieces of the transformers backend's decode loop (models/hf/backend.py): keyed sampling and the batch of rows.

- `draw` / `sample_cdf` draw one token per row by inverting the cumulative distribution with one uniform per
  row (float64 block sums, then a cumulative sum inside one block): exact samples from the row's distribution. It
  replaced `torch.multinomial` (exponential noise over the whole vocabulary from a single-threaded generator,
  then a division and an argmax: about a quarter of decode time here) and the Gumbel-max trick (one hashed
  uniform per vocabulary entry);
- `keyed_uniforms` makes that one uniform a pure function of the row's key (seed, sample index, position), so
  the token a row draws does not depend on which other rows share its batch, nor on their order;
- `DecodeBatch` holds the rows decoding together in one left-padded KV cache, with per-row positions, so
  that rows join (continuous batching) and leave (end of sequence) without changing what any row computes;
- `BufferedLayer` keeps each layer's cache in a preallocated buffer with spare columns, so a decode step
  writes one column in place instead of copying the whole cache (what transformers' DynamicLayer does); rows
  leaving and joining move or write only their own rows in it, where they fit.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

M32 = 0xFFFFFFFF


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (xorshift-multiply rounds) on int64 tensors holding values below 2**32; the
    multipliers stay below 2**31, so no product overflows int64."""
    x = x & M32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & M32
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & M32
    return x ^ (x >> 16)


def keyed_uniforms(keys: torch.Tensor) -> torch.Tensor:
    """One uniform in (0, 1) per row, a pure function of the row's key [seed, sample, position] ([B, 3] int64)."""
    k = hash32(keys[:, 0] ^ 0x5BD1E995)  # each part hashed on its own before combining: small, consecutive
    k = hash32(k ^ hash32(keys[:, 1] + 0x27D4EB2F))  # keys (sample 0..G, position 0..T) spread evenly
    k = hash32(k ^ hash32(keys[:, 2] + 0x165667B1))
    return (k.double() + 0.5) / 2**32  # 2**32 levels: a token below ~1e-9 probability is drawn a little off


def sample_cdf(probs: torch.Tensor, u: torch.Tensor, block: int = 256) -> torch.Tensor:
    """The token of each row whose cumulative probability first exceeds u * (the row's total mass): an exact
    draw from `probs` (unnormalised, [B, V]) for uniforms `u` in [0, 1) ([B]), to float32 rounding of the block
    sums (~1e-6 relative). Two levels, so no cumulative sum runs over the whole vocabulary (torch's is
    sequential per row, and a float64 copy of the probabilities costs more than the sampling): sums of blocks
    of `block` tokens pick the block, a float64 cumulative sum inside it picks the token. Zero-probability
    tokens are never drawn."""
    rows, vocab = probs.shape
    pad = (-vocab) % block
    blocks = torch.nn.functional.pad(probs, (0, pad)).view(rows, -1, block)
    cdf = blocks.sum(-1).double().cumsum(-1)  # [B, vocab / block]; a float32 sum of 256 terms is good to ~1e-6
    target = u.to(cdf.device).double().clamp(max=1 - 2**-53) * cdf[:, -1]
    b = torch.searchsorted(cdf, target[:, None], right=True)[:, 0].clamp(max=cdf.shape[1] - 1)
    before = torch.where(b > 0, cdf.gather(1, (b - 1).clamp(min=0)[:, None])[:, 0], torch.zeros_like(target))
    inside = blocks[torch.arange(rows, device=b.device), b].double().cumsum(-1)  # [B, block]
    rest = torch.minimum(target - before, inside[:, -1] * (1 - 1e-12))  # rounding never walks past the block's mass
    j = torch.searchsorted(inside, rest[:, None], right=True)[:, 0]
    return (b * block + j).cpu()


def draw(logits: torch.Tensor, temperature: float, top_p: float, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from softmax(logits / T), nucleus-truncated to `top_p`, for uniforms `u` ([B]); greedy
    (argmax) at T = 0. Returns the tokens and their log-probs under softmax(logits / T') with T' = T, or 1
    when greedy (models.backend.logprob_temperature): the distribution the tokens were drawn from, before
    truncation. One exponential pass over the logits; no full log-softmax is materialised."""
    z = logits.float() / (temperature if temperature > 0 else 1.0)
    top = z.amax(-1, keepdim=True)
    probs = (z - top).exp_()
    log_mass = probs.sum(-1).log()
    if temperature == 0:
        tok = z.argmax(-1).cpu()
    elif top_p >= 1.0:
        tok = sample_cdf(probs, u)
    else:
        sorted_p, idx = probs.sort(-1, descending=True)
        sorted_p[sorted_p.cumsum(-1) - sorted_p > top_p * sorted_p.sum(-1, keepdim=True)] = 0  # smallest set reaching top_p
        tok = idx.gather(1, sample_cdf(sorted_p, u)[:, None].to(idx.device))[:, 0].cpu()
    at = tok[:, None].to(z.device)
    return tok, (z.gather(1, at) - top)[:, 0] - log_mass


class BufferedLayer(DynamicLayer):
    """One attention layer's keys and values for the rows decoding together, in preallocated buffers
    [rows, kv_heads, capacity, head_dim] with spare columns: a decode step writes its column in place (a
    transformers DynamicLayer concatenates, copying the layer's whole cache at every step); dropping leading
    columns that no row uses any more moves an offset; rows leaving are overwritten in place by rows from the
    end (`move_rows`), so a row leaving copies as many rows as left, not the whole cache. `keys` and `values`
    are views of the rows and columns in use; `update`, `get_seq_length` and `get_mask_sizes` are the calls a
    decode step makes."""

    is_croppable = False

    def __init__(self, kbuf: torch.Tensor, vbuf: torch.Tensor, used: int, spare: int):
        super().__init__()
        self.is_initialized = True
        self.kbuf, self.vbuf, self.start, self.end, self.spare = kbuf, vbuf, 0, used, spare
        self.rows = kbuf.shape[0]  # rows in use: the buffer's first
        self.device = kbuf.device
        self._view()

    @classmethod
    def of(cls, parts: list[tuple[torch.Tensor, torch.Tensor, int]], spare: int) -> BufferedLayer:
        """A buffer holding `parts` ((keys, values, repeat) each) one under another, right-aligned to the widest
        (left padding zeroed: masked columns must hold finite numbers), each row repeated `repeat` times."""
        k0 = parts[0][0]
        width = max(k.shape[2] for k, _, _ in parts)
        rows = sum(k.shape[0] * r for k, _, r in parts)
        kbuf = torch.empty(rows, k0.shape[1], width + spare, k0.shape[3], dtype=k0.dtype, device=k0.device)
        layer = cls(kbuf, torch.empty_like(kbuf), width, spare)
        layer.rows = 0
        for k, v, r in parts:
            layer.append_rows(k, v, r)
        return layer

    def room(self) -> int:
        """Rows the buffer holds beyond those in use (left by rows that left)."""
        return self.kbuf.shape[0] - self.rows

    def append_rows(self, keys: torch.Tensor, values: torch.Tensor, repeat: int) -> None:
        """Rows written in place after those in use, each repeated `repeat` times, right-aligned to the columns
        in use (left padding zeroed: masked columns must hold finite numbers). They must fit: `room`, and no
        wider than the columns in use."""
        b, h, w, d = keys.shape
        width, at = self.end - self.start, self.rows
        for buf, src in ((self.kbuf, keys), (self.vbuf, values)):
            rows = buf[at : at + b * repeat, :, self.start : self.end]
            rows[:, :, : width - w].zero_()
            rows[:, :, width - w :].view(b, repeat, h, w, d).copy_(src[:, None].expand(b, repeat, h, w, d))
        self.rows = at + b * repeat
        self._view()

    def _view(self) -> None:
        self.keys = self.kbuf[: self.rows, :, self.start : self.end]
        self.values = self.vbuf[: self.rows, :, self.start : self.end]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        q = key_states.shape[2]
        if self.end + q > self.kbuf.shape[2]:  # out of spare columns: move the used ones into a wider buffer
            self.kbuf, self.vbuf = (self._fresh(t, q + self.spare) for t in (self.keys, self.values))
            self.start, self.end = 0, self.end - self.start
        self.kbuf[: self.rows, :, self.end : self.end + q].copy_(key_states)
        self.vbuf[: self.rows, :, self.end : self.end + q].copy_(value_states)
        self.end += q
        self._view()
        return self.keys, self.values

    @staticmethod
    def _fresh(used: torch.Tensor, spare: int) -> torch.Tensor:
        """A new buffer with `used`'s rows and columns and `spare` columns after them."""
        return torch.cat([used, used.new_empty(*used.shape[:2], spare, used.shape[3])], 2)

    def move_rows(self, dst: torch.Tensor, src: torch.Tensor, rows: int) -> None:
        """Row src[i] is copied over row dst[i] (the columns in use), then the first `rows` rows are the ones in
        use: rows that left are overwritten by rows from the end, and the buffer keeps its size."""
        if dst.numel():
            for t in (self.keys, self.values):
                t.index_copy_(0, dst, t.index_select(0, src))
        self.rows = rows
        self._view()

    def drop_leading(self, n: int) -> None:
        self.start += n
        self._view()

    def get_seq_length(self, *args) -> int:
        return self.end - self.start

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.end - self.start + query_length, 0

    def get_max_length(self) -> int:
        return -1


class DecodeBatch:
    """The rows decoding together: their KV cache, attention mask, next positions and pending logits.

    Rows of different lengths share one left-padded cache; padding is masked out, and RoPE positions are
    per row (`next_pos`), so merging and dropping rows never changes what any row computes. The cache is a
    transformers DynamicCache whose layers are `BufferedLayer`s (preallocated, `spare` columns to grow into).
    A freshly prefilled batch (`repeat` > 1) holds each prompt's cache once; merging repeats it per sample.
    """

    def __init__(self, spare: int = 64, shared=None):
        self.cache = None
        self.rows: list[tuple[int, int]] = []
        self.mask = self.next_pos = self.logits = self.last = None
        self.spare, self.repeat = spare, 1
        self.shared = shared  # a models.hf.cascade.SharedPrompts: the prompts the rows share, for the cascade

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def width(self) -> int:
        """KV-cache columns the rows use now (0 when empty)."""
        return self.mask.shape[1] if self.rows else 0

    def merge(self, new: DecodeBatch, rows: list[tuple[int, int]]) -> None:
        """Add the rows of a freshly prefilled batch: written into the places of rows that left when they fit
        there (no wider than the batch), else every row's cache copied once into a new buffer."""
        live = self.cache is not None and bool(self.rows)
        old_width = self.mask.shape[1] if live else 0
        width = max(old_width, new.mask.shape[1])  # the merged cache's columns, each part right-aligned
        if self.shared is not None:
            if new.repeat != self.shared.n:
                raise ValueError(f"shared prompts of {self.shared.n} rows each, merged {new.repeat}")
            self.shared.add([(layer.keys, layer.values) for layer in new.cache.layers], new.mask[:: new.repeat],
                            width - old_width if live else 0, width)
        if live and width == old_width and self.cache.layers[0].room() >= len(rows):  # every layer has that room
            for layer, new_layer in zip(self.cache.layers, new.cache.layers):  # into the places rows left
                layer.append_rows(new_layer.keys, new_layer.values, new.repeat)
        else:
            for i, new_layer in enumerate(new.cache.layers):  # layer by layer, each old buffer freed once copied:
                parts = [(new_layer.keys, new_layer.values, new.repeat)]  # at most one layer's cache held twice
                if live:
                    old, self.cache.layers[i] = self.cache.layers[i], None
                    parts.insert(0, (old.keys, old.values, 1))
                    del old
                new.cache.layers[i] = BufferedLayer.of(parts, self.spare)
                del parts, new_layer
            self.cache = new.cache
        if live:
            self.mask = torch.cat([left_pad(self.mask, width, 1), left_pad(new.mask, width, 1)])
            self.next_pos = torch.cat([self.next_pos, new.next_pos])
            self.logits = torch.cat([self.logits, new.logits])
            self.rows += rows
        else:
            self.mask, self.next_pos, self.logits, self.rows = new.mask, new.next_pos, new.logits, list(rows)
        self.last = None

    def select(self, keep: list[int], sampled: torch.Tensor) -> None:
        """Keep the rows `keep` (finished ones leave the batch and its cache); append their sampled token. The
        rows that stay are reordered (`fill_holes`): rows from the end take the places of rows that left."""
        order = fill_holes(keep, len(self.rows))
        idx = torch.tensor(order, dtype=torch.long)
        if len(keep) < len(self.rows):
            if keep:
                moved = [k for k, old in enumerate(order) if old != k]
                dev = self.cache.layers[0].keys.device
                dst, src = torch.tensor(moved, device=dev), torch.tensor([order[k] for k in moved], device=dev)
                for layer in self.cache.layers:
                    layer.move_rows(dst, src, len(keep))
            self.mask, self.next_pos = self.mask[idx], self.next_pos[idx]
            self.rows = [self.rows[k] for k in order]
            if self.shared is not None:
                self.shared.keep(idx)
        self.last = sampled[idx]
        if not keep:
            self.cache = None
            return
        self.mask = torch.cat([self.mask, torch.ones(len(keep), 1, dtype=self.mask.dtype)], dim=1)
        lead = int((self.mask.sum(0) == 0).cumprod(0).sum())  # columns no remaining row uses any more
        if lead:
            self.mask = self.mask[:, lead:]
            for layer in self.cache.layers:
                layer.drop_leading(lead)
            if self.shared is not None:
                self.shared.drop_leading(lead)
        if self.shared is not None:
            self.shared.step(self.mask)


def fill_holes(keep: list[int], total: int) -> list[int]:
    """The rows `keep` (ascending indices among `total`) in their new order: each keeps its place, except that
    the places of rows that left, among the first len(keep), go to the kept rows beyond them.

    >>> fill_holes([0, 2, 3], 4), fill_holes([1, 4], 5), fill_holes([0, 1], 3), fill_holes([], 2)
    ([0, 3, 2], [4, 1], [0, 1], [])
    """
    n = len(keep)
    kept = set(keep)
    holes = [i for i in range(n) if i not in kept]
    order = list(range(n))
    for hole, row in zip(holes, [i for i in keep if i >= n]):
        order[hole] = row
    return order


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
