"""Weight gradients of the vocabulary-sized layers added into `.grad` in place.

At the end of every training backward, autograd builds the input embedding's and the output layer's weight
gradients as new [vocabulary, hidden] tensors and only then adds them to `.grad`: the embedding's dense backward
(a zeroed [V, d] tensor filled by index), the output layer's `grad_logits^T @ h`, and, for SmolLM2's tied
embedding (one weight for both), their sum and its accumulation into `.grad`. Measured on a standalone GRPO
step of SmolLM2-135M (a tensor-tracking dispatch mode; ad-hoc script, figures in `git show 7f3fe64:docs/performance.md`) these
were four 108 MiB temporaries alive at once at the step's peak, the last op of the backward. Under
`grads_in_place(model)`:
- the embedding's backward is `weight.grad.index_add_(0, ids, grad)`, skipping `padding_idx` as
  `F.embedding`'s backward does;
- the output layer's backward is `weight.grad.addmm_(grad^T, h)` and `grad @ weight` for its input;
so neither allocates anything vocabulary-sized. The gradients are autograd's to float rounding (the sums run
in another order; tests/test_grad_into.py compares them, tied and untied, over accumulated backward calls).

Choices:
- the weight's gradient bypasses autograd's accumulation (the functions return None for it and write
  `.grad`, allocating it zeroed if absent), so it exists only after `.backward()`; `torch.autograd.grad`
  would not see it. Training calls `.backward()` only, and only inside the block;
- patched per module instance for the `with` block only, and only where it is exactly the library's
  computation: a plain embedding (no max_norm, scale_grad_by_freq or sparse) or a bias-free linear head whose
  weight requires a gradient (a LoRA model's frozen embedding keeps the library's forward); a call without
  gradients, or a head called under autocast (its backward would then mix dtypes), runs the library's forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from models.training.forward_patch import patched_forwards


def _grad_buffer(weight: torch.Tensor) -> torch.Tensor:
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    return weight.grad


class _EmbeddingInto(torch.autograd.Function):
    """F.embedding whose weight gradient is index-added into weight.grad."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx = weight, padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        flat, rows = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
        if ctx.padding_idx is not None:
            keep = flat != ctx.padding_idx
            flat, rows = flat[keep], rows[keep]
        _grad_buffer(weight).index_add_(0, flat, rows.to(weight.dtype))
        return None, None, None


class _LinearInto(torch.autograd.Function):
    """h @ weight^T whose weight gradient is added into weight.grad by one in-place matmul."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h)
        ctx.weight = weight
        return F.linear(h, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (h,) = ctx.saved_tensors
        weight = ctx.weight
        rows = grad.reshape(-1, grad.shape[-1])
        _grad_buffer(weight).addmm_(rows.t(), h.reshape(-1, h.shape[-1]).to(rows.dtype))
        grad_h = grad @ weight.to(grad.dtype) if ctx.needs_input_grad[0] else None
        return grad_h, None


def _embedding_forward(module: torch.nn.Embedding):
    library = module.forward  # the instance's own forward, if set, else its class's

    def forward(ids: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and module.weight.requires_grad):
            return library(ids)
        return _EmbeddingInto.apply(ids, module.weight, module.padding_idx)
    return forward


def _head_forward(module: torch.nn.Linear):
    library = module.forward  # the instance's own (a backend's packed linear, models/hf/packed.py) or its class's

    def forward(h: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and module.weight.requires_grad) or torch.is_autocast_enabled(h.device.type):
            return library(h)
        return _LinearInto.apply(h, module.weight)
    return forward


def in_place_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, Callable]]:
    """(module, in-place forward) for `model`'s input embedding and output layer, where the patch is exact."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    out = []
    emb = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    if (type(emb) is torch.nn.Embedding and emb.max_norm is None and not emb.scale_grad_by_freq
            and not emb.sparse and emb.weight.requires_grad):
        out.append((emb, _embedding_forward(emb)))
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if type(head) is torch.nn.Linear and head.bias is None and head.weight.requires_grad:
        out.append((head, _head_forward(head)))
    return out


def grads_in_place(model: torch.nn.Module, enabled: bool = True):
    """Within the block, `model`'s embedding and output layer add their weight gradients into `.grad` in
    place (see the module docstring)."""
    return patched_forwards(in_place_modules(model) if enabled else [])
