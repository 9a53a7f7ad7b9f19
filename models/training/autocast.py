"""bf16 autocast for training and scoring passes, by the device's native bf16 (models/devices.py).

It lives with the training kernels, not in the transformers backend, so the pure cores (tasks/core/grpo.py,
passes.py, prefix.py) that run under it import no backend."""

from __future__ import annotations

import contextlib

import torch

from models.devices import bf16_chosen


def autocast(device: str, dtype: str):
    """bf16 autocast where `dtype` asks for it ("bf16"), or allows it ("auto") on a device that computes bf16
    natively; else no autocast."""
    if bf16_chosen(device, dtype):
        return torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16)
    return contextlib.nullcontext()


def no_autocast(device: str):
    """Autocast off inside a caller's autocast context, without ending it: leaving this context does not clear
    the outer context's cast cache (torch clears it only when the outermost autocast context exits), so weights
    cast once stay cast across micro-batches while a loss, an output layer or a backward runs in full precision."""
    return torch.autocast(device_type=device.split(":")[0], enabled=False)
