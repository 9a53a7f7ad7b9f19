"""Decode-step attention over a prompt that a group of rows shares (a cascade), for the transformers backend.

The decode batch (models/hf/decoding.py) repeats each prompt's KV cache for its n samples, and SDPA reads every
row's copy at every decode step: at 64 rows over 300-token prompts that is about a third of a fp32 decode step
on 2 AVX2 cores (benchmarks/decode_attention.py). The cascade (the idea of Hydragen, arXiv 2402.05099) splits
each row's attention in two parts and merges them exactly:
- the prompt: the queries of a group's rows, and of the query heads that share a KV head, attend to the
  prompt's keys and values once, as one matrix product per group and KV head ([n x 3, D] @ [D, P]);
- the row's own tokens: each row attends to the columns after its prompt (at most the tokens it generated);
- the two softmax parts merge by their log-sum-exp: out = (o_p e^(m_p - m) + o_s e^(m_s - m)) / (l_p e^(m_p - m)
  + l_s e^(m_s - m)), the same attention to float rounding (tests/test_cascade.py).

Choices:
- `SharedPrompts` keeps each prompt's keys and values once per layer (left-padded to the widest prompt, with a
  mask, in float32), beside the batch's own cache, which is unchanged (the prompt columns stay there too: the
  cascade reads them only from here). That costs 1/n more cache memory (2/n over a bf16 cache), and keeps the
  plain path one flag away;
- rows are addressed by (group, slot): slot j is sample j of its prompt, so a group's queries form a [n, ...]
  block without gathering keys; rows that left leave a zero query in their slot (computed, never read back);
- the SDPA entry of transformers' attention registry is wrapped once (`install`): a call that carries
  `shared_prompts` (a decode step of one token per row) takes the cascade, a bf16 decode step that carries
  `float32_decode_attention` the float32 attention of models/hf/decode_attention.py, every other call (prefill,
  scoring, training, other models) goes to SDPA unchanged;
- the cascade computes in float32 for any cache: a half-precision (bf16) cache's prompts are cast to float32
  once, when they join (`add`), and each step casts only the rows' own columns; a bf16 product would round the
  scores to bf16 before the softmax. Its baseline there is models/hf/decode_attention.py's float32 attention,
  which casts every row's whole copy at every step;
- a step takes the cascade only where it pays (`step`, the MIN_* thresholds below, measured on 2 AVX2 cores
  for float32 caches, checked on 2 AVX512_BF16 cores for bf16 ones); a bf16 cache on a GPU stays on SDPA,
  where the float32 cascade was never measured. On a CPU with AMX the bf16 decoder uses neither this nor
  the float32 attention (models/hf/backend.py: torch's SDPA over the bf16 cache runs on AMX's tiles and was faster
  there than both).
"""

from __future__ import annotations

import contextlib

import torch

from models.hf import decode_attention
from models.hf.decoding import left_pad

SHARED_KWARG = "shared_prompts"  # the keyword a decode step hands its SharedPrompts to the attention by
FLOAT32_KWARG = "float32_decode_attention"  # the keyword (True) by which a decode step asks for decode_attention.py
_float32_without_keyword = False  # what a call without the keyword gets (`float32_decode_steps`)
# A step takes the cascade only with at least this many rows, this many per prompt on average, and prompts of
# this many tokens on average; else SDPA. With few rows left per prompt the cascade reads as much as SDPA and
# runs more, smaller products (2 AVX2 cores, ~330-token prompts x 8 samples, a first version: 166 against
# 101 ms a step at 8 rows, 305 against 290 at 32, 320 against 379 at 48); over short prompts SDPA's one pass
# is cheaper (64 rows, 8 prompts, per layer: 0.92x at 60 prompt tokens and 10 own, 0.84x at 60 and 40, 1.85x
# at 150 and 10, 1.19x at 150 and 40, 2.32x at 300 and 20)
MIN_ROWS, MIN_ROWS_PER_PROMPT, MIN_PROMPT_TOKENS = 32, 4, 128
# The same thresholds serve a bf16 cache, whose baseline (decode_attention.py: float32 over every row's copy) is
# cheaper than fp32 SDPA: on 2 AVX512_BF16 cores the embedded policy's generate over 388-token few-shot prompts x 8
# samples ran 1.46x faster with them, 1.25x when the cascade also needed 8 rows a prompt (benchmarks/
# decode_attention.py --generate); single steps at 300 prompt tokens: 1.22x at 8 rows a prompt (32 rows), 1.10x at
# 4; at 150 tokens 1.04x and 0.97x; short plain prompts stay on the float32 path.


class SharedPrompts:
    """The prompts a decode batch's rows share, per layer, and which prompt (group) and slot each row is."""

    def __init__(self, n: int):
        self.n = n  # slots per group: the samples per prompt
        self.keys: list[torch.Tensor] = []  # per layer [G, KV, P, D], each prompt right-aligned, left-padded
        self.values: list[torch.Tensor] = []
        self.prompt_mask: torch.Tensor | None = None  # [G, P] bool: the prompt's own columns
        self.group = torch.zeros(0, dtype=torch.long)  # [B]: each row's prompt
        self.slot = torch.zeros(0, dtype=torch.long)  # [B]: each row's sample index (0..n-1)
        self.end = torch.zeros(0, dtype=torch.long)  # [G]: the batch cache's column where each prompt ends
        self.active = False  # does the current step take the cascade (`step`)
        self.half = False  # the batch's cache is half precision (its prompts are kept here in float32)

    def step(self, row_mask: torch.Tensor) -> None:
        """A decode step is next, with this attention mask ([B, W], this step's column included): decide whether
        the cascade pays for it, and prepare what every layer's call shares (the rows' own-column window and
        its additive mask, the prompts' additive mask, where each row's queries go)."""
        rows = self.group.numel()
        self.active = (rows >= MIN_ROWS and rows >= MIN_ROWS_PER_PROMPT * self.groups
                       and int(self.prompt_mask.sum()) >= MIN_PROMPT_TOKENS * self.groups
                       and (not self.half or self.keys[0].device.type == "cpu"))
        if not self.active:
            return
        dev = self.keys[0].device if self.keys else row_mask.device
        self.full = rows == self.groups * self.n and self.in_grid_order()  # rows are the [G, n] grid in order
        self.group_on, self.slot_on = self.group.to(dev), self.slot.to(dev)
        end = self.end.to(dev)[self.group_on]  # [B]
        self.start = int(end.min())  # the oldest prompt's end bounds the window of own columns
        cols = torch.arange(self.start, row_mask.shape[1], device=dev)
        own = (cols[None, :] >= end[:, None]) & row_mask.to(dev)[:, self.start:].bool()
        self.own_bias = torch.zeros(own.shape, device=dev).masked_fill_(~own, float("-inf"))[:, None, None, :]
        self.prompt_bias = torch.zeros(self.prompt_mask.shape, device=dev).masked_fill_(
            ~self.prompt_mask.to(dev), float("-inf"))[:, None, None, :]

    def in_grid_order(self) -> bool:
        """Whether row r is slot r % n of group r // n (rows leaving reorder the rest: models/hf/decoding.py)."""
        grid = torch.arange(self.groups * self.n)
        return torch.equal(self.group, grid // self.n) and torch.equal(self.slot, grid % self.n)

    @property
    def groups(self) -> int:
        return self.end.numel()

    def add(self, layers: list[tuple[torch.Tensor, torch.Tensor]], prompt_mask: torch.Tensor, shift: int,
            end: int) -> None:
        """Prompts just prefilled: `layers` their [prompts, KV, W_p, D] keys and values (left-padded), `prompt_mask`
        [prompts, W_p]; each has n rows appended to the batch in prompt order. `shift`: columns the batch's cache
        gained on the left for the rows already there; `end`: where the new prompts end in it."""
        prompts = prompt_mask.shape[0]
        first = self.groups
        self.end = torch.cat([self.end + shift, torch.full((prompts,), end, dtype=torch.long)])
        self.group = torch.cat([self.group, torch.arange(first, first + prompts).repeat_interleave(self.n)])
        self.slot = torch.cat([self.slot, torch.arange(self.n).repeat(prompts)])
        mask = prompt_mask.bool()
        self.half = self.half or any(k.dtype in decode_attention.CAST for k, _ in layers)
        layers = [(k.float(), v.float()) for k, v in layers]  # a half-precision cache's prompts: cast once, here
        if first == 0:
            self.keys, self.values = [k for k, _ in layers], [v for _, v in layers]
            self.prompt_mask = mask
            return
        width = max(self.prompt_mask.shape[1], mask.shape[1])
        self.prompt_mask = torch.cat([left_pad(self.prompt_mask, width, 1), left_pad(mask, width, 1)])
        for i, (k, v) in enumerate(layers):
            self.keys[i] = torch.cat([left_pad(self.keys[i], width, 2), left_pad(k, width, 2)])
            self.values[i] = torch.cat([left_pad(self.values[i], width, 2), left_pad(v, width, 2)])

    def keep(self, rows: torch.Tensor) -> None:
        """Keep the rows `rows` (indices into the current rows, in order); prompts no row uses any more go."""
        self.group, self.slot = self.group[rows], self.slot[rows]
        used = torch.unique(self.group)
        if used.numel() == self.groups:
            return
        renumber = torch.full((self.groups,), -1, dtype=torch.long)
        renumber[used] = torch.arange(used.numel())
        self.group = renumber[self.group]
        self.end, self.prompt_mask = self.end[used], self.prompt_mask[used]
        width = int(self.prompt_mask.any(0).long().argmax()) if used.numel() else 0  # padding no prompt needs now
        self.prompt_mask = self.prompt_mask[:, width:]
        dev = self.keys[0].device if self.keys else used.device
        on = used.to(dev)
        self.keys = [k.index_select(0, on)[:, :, width:] for k in self.keys]
        self.values = [v.index_select(0, on)[:, :, width:] for v in self.values]

    def drop_leading(self, n: int) -> None:
        """The batch's cache dropped its first n columns."""
        self.end = self.end - n

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float) -> torch.Tensor:
        """Attention of one query token per row ([B, H, 1, D]) over the row's prompt (from here) and its own
        columns of the batch's cache (`key`/`value` [B, KV, W, D], after this step's column was written);
        returns [B, 1, H, D] in the query's dtype, as transformers' attention functions do. `step` ran first
        and took the cascade. Computed in float32 whatever the cache's dtype, autocast off."""
        with torch.autocast(query.device.type, enabled=False):  # a bf16 decoder's autocast would undo the casts
            return self._attend(layer, query.float(), key, value, scaling).to(query.dtype)

    def _attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                scaling: float) -> torch.Tensor:
        rows, heads, _, dim = query.shape
        kv = key.shape[1]
        per = heads // kv
        groups, n = self.groups, self.n
        q = (query * scaling).view(rows, kv, per, dim)
        # the prompt part: [G, KV, n x per, D] queries against [G, KV, P, D]
        if self.full:
            qg = q.view(groups, n, kv, per, dim)
        else:
            qg = q.new_zeros(groups, n, kv, per, dim)
            qg[self.group_on, self.slot_on] = q
        qg = qg.permute(0, 2, 1, 3, 4).reshape(groups, kv, n * per, dim)
        s = torch.matmul(qg, self.keys[layer].transpose(-1, -2)) + self.prompt_bias  # [G, KV, n x per, P]
        m_p = s.amax(-1, keepdim=True)
        e = torch.exp(s - m_p)
        l_p = e.sum(-1, keepdim=True)
        o_p = torch.matmul(e, self.values[layer])  # [G, KV, n x per, D]
        both = torch.cat([o_p, m_p, l_p], -1).view(groups, kv, n, per, dim + 2).permute(0, 2, 1, 3, 4)
        both = both.reshape(rows, kv, per, dim + 2) if self.full else both[self.group_on, self.slot_on]
        o_p, m_p, l_p = both[..., :dim], both[..., dim:dim + 1], both[..., dim + 1:]
        # the row's own part: the columns after its prompt
        s = torch.matmul(q, key[:, :, self.start:].float().transpose(-1, -2)) + self.own_bias  # [B, KV, per, W']
        m_s = s.amax(-1, keepdim=True)
        e = torch.exp(s - m_s)
        l_s = e.sum(-1, keepdim=True)
        o_s = torch.matmul(e, value[:, :, self.start:].float())  # [B, KV, per, D]
        m = torch.maximum(m_p, m_s)
        a, b = torch.exp(m_p - m), torch.exp(m_s - m)
        out = (o_p * a + o_s * b) / (l_p * a + l_s * b)
        return out.reshape(rows, heads, 1, dim).transpose(1, 2)


_installed = False


@contextlib.contextmanager
def float32_decode_steps(on: bool):
    """Inside the block, bf16 decode steps that carry no `float32_decode_attention` keyword (transformers'
    own `model.generate`, which refuses unknown keywords: the benchmarks' forced-length ceilings) take
    models/hf/decode_attention.py when `on`, as the backend's own steps do where it chose that path
    (models/hf/backend.py decode_attention_paths). Needs `install`."""
    global _float32_without_keyword
    before, _float32_without_keyword = _float32_without_keyword, on
    try:
        yield
    finally:
        _float32_without_keyword = before


def install() -> None:
    """Wrap transformers' SDPA attention once, so a call carrying `shared_prompts` takes the cascade, and a
    bf16 decode step on the CPU that carries `float32_decode_attention` takes models/hf/decode_attention.py."""
    global _installed
    if _installed:
        return
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import AttentionInterface

    def sdpa_or_cascade(module, query, key, value, attention_mask, *args, **kwargs):
        shared = kwargs.pop(SHARED_KWARG, None)
        float32 = kwargs.pop(FLOAT32_KWARG, _float32_without_keyword)
        scaling = kwargs.get("scaling")
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        if shared is not None and shared.active and query.shape[2] == 1:
            return shared.attend(module.layer_idx, query, key, value, scaling), None
        if float32 and not args and decode_attention.applies(query, key, attention_mask, kwargs):
            return decode_attention.attend(query, key, value, attention_mask, scaling), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)

    AttentionInterface.register("sdpa", sdpa_or_cascade)
    _installed = True
