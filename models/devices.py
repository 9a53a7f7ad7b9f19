"""What a device computes natively: whether bf16 runs in hardware (the decoder's weights, training's autocast
and the packed decode products all choose by it), and whether a CPU has AMX's bf16 tiles (the decoder's bf16
attention path chooses by it: models/hf/backend.py).

The CPU's flags are read once from /proc/cpuinfo (none where it cannot be read: no bf16, no AMX)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (`lscpu`'s Flags), empty where /proc/cpuinfo cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return frozenset()


def native_bf16(device: str) -> bool:
    """Does this device compute bf16 natively? Without it (e.g. AVX-512 but no AVX512_BF16/AMX), CPU bf16
    autocast is emulated and measured ~2.5x *slower* than fp32 here, so "auto" only picks bf16 with it."""
    if device.startswith("cuda"):
        return torch.cuda.is_bf16_supported()
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def amx_bf16(device: str) -> bool:
    """Is `device` a CPU with AMX's bf16 tile products that this process may use? There torch's CPU attention
    over bf16 tensors runs on them, 3-4x faster than a float32 cast for one query token per row
    (benchmarks/decode_step.py). Linux grants the tiles' state per process on request; torch's `_init_amx`
    asks (where this torch lacks it, the flag alone decides)."""
    return device.split(":")[0] == "cpu" and "amx_bf16" in cpu_flags() and amx_granted()


@functools.cache
def amx_granted() -> bool:
    """Whether the OS lets this process use AMX's tiles (asked once)."""
    init = getattr(torch.cpu, "_init_amx", None)
    return bool(init()) if init is not None else True


def bf16_chosen(device: str, dtype: str) -> bool:
    """Whether `dtype` asks for bf16 ("bf16") or allows it ("auto") on a device that computes bf16 natively."""
    return dtype == "bf16" or (dtype == "auto" and native_bf16(device))
