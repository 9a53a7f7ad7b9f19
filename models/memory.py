"""Giving freed memory back to the operating system.

A round allocates and frees gigabytes of short-lived tensors (a decode batch's KV cache, a training pass's
activations and logits). glibc keeps much of what is freed in its heaps for reuse, so the process's resident
size only grows: measured on SmolLM2-135M training, about 1.1 GB of every optimizer step's freed activations
stayed resident and the next step's peak stacked on it. `release_memory` runs the garbage collector and asks
glibc to return free heap pages (`malloc_trim(0)`, a few milliseconds); elsewhere it only collects. It is
called after each optimizer step, after every stage, and when backends are dropped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc


@functools.cache
def _trim():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return getattr(libc, "malloc_trim", None)


def release_memory() -> None:
    """Collect garbage and return free heap memory to the OS where the C library can (glibc)."""
    gc.collect()
    trim = _trim()
    if trim is not None:
        trim(0)
