"""Decode-step attention over a bf16 KV cache on the CPU, computed in float32.

A decode step asks one query token per row to attend to the row's whole cache. torch's CPU SDPA over bf16
tensors runs such one-token queries far from the machine's limits: on 2 AVX512_BF16 cores (no AMX), SmolLM2's 9
query heads over 3 KV heads of 64 dims and 300 cached tokens took 0.22 ms for 1 row, 1.4 ms for 8 and 5.3 ms
for 32 per layer call (x 30 layers: over 40% of a bf16 decode step at 8 rows), while this float32 path took a
quarter to a half of that (benchmarks/decode_step.py prints both). For longer queries (prefill, scoring,
extending MCMC states) bf16 SDPA is as fast as a cast, so only decode steps take this path.

The method: cast the query, keys and values to float32, compute the grouped-query scores as one matrix product
per KV head ([rows, KV, heads per KV, D] @ [rows, KV, D, W], no key repeated per query head), add the mask,
softmax, weight the values, and cast the output back to the query's dtype. Choices:
- float32 throughout, not bf16 products: a bf16 product rounds each score to bf16 before the softmax (errors of
  5e-3 in the output against 1e-3 for bf16 SDPA, which accumulates in float32); the cast path's output differs
  from an all-float32 reference by float32 rounding (4e-7), so it is closer to it than bf16 SDPA is. The
  decoder runs its steps under bf16 autocast, which would turn these float32 products back into bf16 ones,
  so `attend` turns autocast off for its own ops;
- the casts copy the row's keys and values once per layer and step (a decode step's attention reads them once
  anyway); the cache itself stays bf16, so its memory is unchanged;
- only for decode steps (one query token) without gradients on the CPU with a bf16 or fp16 cache, and only for
  the masks a causal decoder is given (none, boolean, or additive); everything else goes to SDPA unchanged
  (`applies`). A decode step asks for this path (models/hf/cascade.py's `float32_decode_attention` keyword), and
  the backend asks only on a CPU without AMX: with AMX's tiles bf16 SDPA was 3-4x faster than the cast
  (models/hf/backend.py decode_attention_paths). A row whose mask hides every column would give NaN here, as SDPA's
  math kernel does; a decode step's row always attends at least to its own token.
"""

from __future__ import annotations

import torch

CAST = (torch.bfloat16, torch.float16)
# keywords transformers' attention call carries that do not change a decode step's attention; any other one
# (a position bias, a softcap, attention sinks, ...) sends the call to SDPA
PLAIN = {"scaling", "dropout", "is_causal", "position_ids", "use_cache", "cache_position"}


def applies(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict) -> bool:
    """Whether a call of transformers' SDPA attention takes `attend`: one query token per row, no gradient, a
    half-precision CPU cache, grouped heads that divide evenly, a mask shared by the heads, no dropout, and
    nothing else that changes attention."""
    extras = {k for k, v in kwargs.items() if v is not None and k not in PLAIN}
    return (query.shape[2] == 1 and query.device.type == "cpu" and query.dtype in CAST and key.dtype == query.dtype
            and not torch.is_grad_enabled() and query.shape[1] % key.shape[1] == 0 and not extras
            and not kwargs.get("dropout") and (attention_mask is None or attention_mask.dim() == 4
                                                and attention_mask.shape[1] == 1))


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
           scaling: float) -> torch.Tensor:
    """Attention of one query token per row ([B, H, 1, D]) over [B, KV, W, D] keys and values, in float32;
    returns [B, 1, H, D] in the query's dtype, as transformers' attention functions do. `attention_mask`: None,
    boolean (True: attend) or additive, broadcastable to [B, 1, 1, W] (columns past W are dropped)."""
    rows, heads, _, dim = query.shape
    kv, width = key.shape[1], key.shape[2]
    with torch.autocast(query.device.type, enabled=False):  # the decoder's bf16 autocast would undo the casts
        q = query.float().view(rows, kv, heads // kv, dim) * scaling
        scores = torch.matmul(q, key.float().transpose(-1, -2))  # [B, KV, per, W]
        if attention_mask is not None:
            mask = attention_mask[..., -1:, :width]  # this step's row of the mask
            if mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask, float("-inf"))
            else:
                scores = scores + mask.float()
        out = torch.matmul(torch.softmax(scores, -1), value.float())  # [B, KV, per, Dv]
    return out.view(rows, heads, 1, value.shape[-1]).transpose(1, 2).to(query.dtype)
