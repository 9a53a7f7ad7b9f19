"""Prepacked linear layers for the CPU decode loop (models/hf/backend.py): fp32 weights, and bf16 weights where oneDNN
computes bf16 natively (AVX512_BF16 or AMX).

A decode step multiplies a few rows (one token per row, at most the batch size) by every weight matrix. MKL's
GEMM, which `nn.Linear` calls on CPU, runs such thin products far from the machine's limits: on 2 AVX2 cores a
decode step of SmolLM2-135M over 300 tokens of context took 141-184 ms at 4-16 rows and 411 ms at 64 (medians
of 3, interleaved). oneDNN's matmul over weights reordered once into its own blocked layout
(`torch.ops.mkldnn._reorder_linear_weight` and `_linear_pointwise`, the kernels torch.compile's CPU weight
freezing emits) took 89-146 ms and 350 ms: 1.15-1.6x from 1 to 64 rows (table in `git show 7f3fe64:docs/performance.md`;
benchmarks/shape.py --baseline measures it in context). bf16 weights gain alike: on 2 AVX512_BF16 cores (no
AMX) the model's products took 1.1-2.2x less time packed than through `F.linear` from 1 to 32 rows, the
49,152-wide output layer 2.0-2.2x at 1-8 rows (benchmarks/decode_step.py, which also times the decode step).

Choices:
- fp32 or bf16 weights (all one of the two) on the CPU only, rows of the weights' dtype, without gradients,
  and only for calls of at most `MAX_ROWS` rows (the decode steps): prefill, scoring and training multiply
  hundreds of rows, where MKL was as fast or faster (oneDNN 0.8-0.9x on the 1536 -> 576 projection at
  128-2048 rows, fp32); bf16 only where the CPU computes bf16 natively (AVX512_BF16 or AMX: an AVX-512 CPU
  without them passes oneDNN's own bf16 check but emulates it, unmeasured; the decoder runs fp32 there);
- a layer's packed copy is made on its first such call and made again when its weight changes (the tensor's
  version counter or storage: an optimizer step or a checkpoint load writes the weight in place). The copies
  are a second copy of the weights (0.5 GiB for the 135M model in fp32, 0.25 GiB in bf16); they go with the model (backends are
  dropped before training builds its optimizer state: models/registry.py release_backends);
- `install` checks the packed product against `F.linear` on random rows first; a missing operator (a torch
  built without oneDNN) or a mismatch leaves the model on MKL, and says so in the log.
Results differ from MKL's by float rounding (1e-6 relative in fp32), as any two GEMM kernels do; in bf16 the
two agreed bit for bit on the model's shapes here.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from models.devices import native_bf16

log = logging.getLogger("refinery.models")

DTYPES = (torch.float32, torch.bfloat16)
MAX_ROWS = 64  # rows per call up to which the packed kernel is used (the default decode batch)
PACK_HINT = 16  # oneDNN's batch-size hint for the weight layout; 16 and 64 measured alike from 1 to 64 rows


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_HINT)


class PackedForward:
    """The forward of one `nn.Linear`: the packed oneDNN product for a few rows without gradients, the
    layer's own `F.linear` otherwise."""

    def __init__(self, layer: torch.nn.Linear):
        self.layer = layer
        self.packed: torch.Tensor | None = None
        self.key: tuple[int, int] | None = None

    def __getstate__(self) -> dict:
        # a copied or pickled model (a trainer's deepcopy of the policy) repacks on its own first decode call:
        # oneDNN's packed tensor has no storage to copy
        return {"layer": self.layer, "packed": None, "key": None}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.layer.weight, self.layer.bias
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if torch.is_grad_enabled() or rows > MAX_ROWS or rows == 0 or x.dtype != w.dtype or w.dtype not in DTYPES:
            return F.linear(x, w, b)
        key = (w.data_ptr(), w._version)
        if key != self.key:
            self.packed, self.key = pack_weight(w), key
        y = packed_linear(x.reshape(rows, x.shape[-1]), self.packed, b)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def usable(device: str, model: torch.nn.Module) -> str | None:
    """Why the packed path cannot serve `model` on `device`, or None when it can."""
    if device != "cpu":
        return f"device {device}"
    dtypes = {p.dtype for p in model.parameters()}
    if len(dtypes) != 1 or not dtypes <= set(DTYPES):
        return f"weights not all fp32 or all bf16 ({', '.join(sorted(str(d).removeprefix('torch.') for d in dtypes))})"
    dtype = dtypes.pop()
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "torch built without oneDNN"
    if dtype == torch.bfloat16 and not (native_bf16(device) and getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported",
                                                                       lambda: False)()):
        return "no native bf16 on this CPU (oneDNN would emulate it)"
    try:  # the operators exist and agree with F.linear on random rows
        gen = torch.Generator().manual_seed(0)
        w, x = torch.randn(96, 64, generator=gen).to(dtype), torch.randn(5, 64, generator=gen).to(dtype)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        if not torch.allclose(packed_linear(x, pack_weight(w), None).float(), F.linear(x, w).float(), rtol=tol, atol=tol):
            return "oneDNN's packed product disagrees with F.linear"
    except (RuntimeError, AttributeError) as e:
        return f"oneDNN's packed product failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    return None


def install(model: torch.nn.Module, device: str) -> bool:
    """Route `model`'s linear layers through `PackedForward` where `usable`; returns whether it did (logged)."""
    why_not = usable(device, model)
    if why_not:
        log.info("decode steps on MKL's GEMM (packed oneDNN linears not used: %s)", why_not)
        return False
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for layer in layers:
        layer.forward = PackedForward(layer)
    log.info("decode steps on packed oneDNN linears (%d layers, up to %d rows a call)", len(layers), MAX_ROWS)
    return True


def installed(model: torch.nn.Module) -> bool:
    return any(isinstance(m.__dict__.get("forward"), PackedForward) for m in model.modules())


def uninstall(model: torch.nn.Module) -> None:
    """Back to `nn.Linear`'s own forward everywhere; the packed copies go with it."""
    for m in model.modules():
        if isinstance(m.__dict__.get("forward"), PackedForward):
            del m.forward
