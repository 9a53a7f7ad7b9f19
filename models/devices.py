"""What a device computes natively: whether bf16 runs in hardware (the decoder's weights, training's autocast
and the packed decode products all choose by it)."""

from __future__ import annotations

import torch


def native_bf16(device: str) -> bool:
    """Does this device compute bf16 natively? Without it (e.g. AVX-512 but no AVX512_BF16/AMX), CPU bf16
    autocast is emulated and measured ~2.5x *slower* than fp32 here, so "auto" only picks bf16 with it."""
    if device.startswith("cuda"):
        return torch.cuda.is_bf16_supported()
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
