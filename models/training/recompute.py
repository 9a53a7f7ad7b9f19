"""Memory-lean training passes: a decoder layer's cheap elementwise blocks rerun in the backward.

Autograd keeps every intermediate that an op's backward reads. In a Llama-style layer (SmolLM2's) two
elementwise blocks keep more than their inputs:
- RMSNorm, `w * (x * rsqrt(mean(x^2) + eps))`, keeps its input x and also the normalized x before the weight
  (the rsqrt too, one float per token);
- the MLP's gate, `act(gate) * up`, keeps gate, act(gate) and up.
Under `lean_activations(model)` each of them keeps only its inputs (x and the weight; gate and up) and reruns its
own forward under autograd in the backward (with the autocast state it ran under), so its outputs are the
library's bit for bit and the gradients are autograd's over the same ops, to float rounding (about 3e-7
relative: the rerun's gradient reaches the residual stream as one sum where the library's adds up op by op;
tests/test_recompute.py). A layer then keeps 2 x hidden + intermediate fewer floats per token (576 x 2 + 1,536
for SmolLM2-135M, about a fifth of a training pass's saved activations). The rerun is elementwise over
[tokens, hidden] and [tokens, intermediate], small beside the layer's matmuls; the projections around it are
called as they are (LoRA layers included).

Choices:
- the patch is per module instance and lasts only the `with` block (training's forward and backward): decoding
  keeps the library's forward, where a Python autograd function per call would add to every decode step;
- modules are recognized by what they hold, not by class: an RMSNorm is a module whose class name ends in
  "RMSNorm" with a `weight` and a `variance_epsilon`; a gated MLP one with `gate_proj`, `up_proj`, `down_proj`
  and `act_fn`. Anything else runs unchanged, so a model of another family trains as before;
- `rms_norm` restates transformers' LlamaRMSNorm forward op for op (fp32 inside, the weight applied in the
  input's dtype); a test compares it with the library's module bit for bit, so a library change that altered
  the norm fails there instead of training silently on a different function.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from models.training.forward_patch import patched_forwards


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm forward: normalized in fp32, scaled by the weight in the input's dtype."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class _Rerun(torch.autograd.Function):
    """fn(*args) keeping only args for the backward, which reruns fn under autograd and the forward's autocast."""

    @staticmethod
    def forward(ctx, fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
        ctx.fn = fn
        ctx.device = args[0].device.type
        ctx.autocast = torch.is_autocast_enabled(ctx.device)
        ctx.autocast_dtype = torch.get_autocast_dtype(ctx.device)
        ctx.save_for_backward(*args)
        return fn(*args)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        args = [a.detach().requires_grad_(need) for a, need in zip(ctx.saved_tensors, ctx.needs_input_grad[1:])]
        with torch.enable_grad(), torch.autocast(ctx.device, dtype=ctx.autocast_dtype, enabled=ctx.autocast):
            out = ctx.fn(*args)
        wanted = [a for a in args if a.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        return (None, *(next(grads) if a.requires_grad else None for a in args))


def _gate(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return lambda gate, up: act(gate) * up


def _lean_norm_forward(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    eps = module.variance_epsilon

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return rms_norm(hidden_states, module.weight, eps)
        return _Rerun.apply(lambda x, w: rms_norm(x, w, eps), hidden_states, module.weight)
    return forward


def _lean_mlp_forward(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    gate = _gate(module.act_fn)

    def forward(x: torch.Tensor) -> torch.Tensor:
        g, u = module.gate_proj(x), module.up_proj(x)
        return module.down_proj(_Rerun.apply(gate, g, u) if torch.is_grad_enabled() else gate(g, u))
    return forward


def lean_modules(model: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor]]]:
    """(module, lean forward) for every RMSNorm and gated MLP of `model` (see the module docstring)."""
    for module in model.modules():
        if (type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")
                and isinstance(getattr(module, "weight", None), torch.Tensor)):
            yield module, _lean_norm_forward(module)
        elif all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            yield module, _lean_mlp_forward(module)


def lean_activations(model: torch.nn.Module, enabled: bool = True):
    """Within the block, `model`'s RMSNorms and gated MLPs keep only their inputs for the backward."""
    return patched_forwards(lean_modules(model) if enabled else [])
