"""Giving freed memory back to the operating system.

A round allocates and frees gigabytes of short-lived tensors (a decode batch's KV cache, a training pass's
activations and logits). glibc keeps much of what is freed in its heaps for reuse, so the process's resident
size only grows: measured on SmolLM2-135M training, about 1.1 GB of every optimizer step's freed activations
stayed resident and the next step's peak stacked on it. `release_memory` runs the garbage collector and asks
glibc to return free heap pages (`malloc_trim(0)`, a few milliseconds); elsewhere it only collects. It is
called after each optimizer step, after every stage, and when backends are dropped. `trim_heap` is the trim
alone, without the collector's pass over every Python object: training calls it after each forward/backward
pass, where the next pass's tensors come in other sizes and would otherwise stack on the free-but-resident
heap the last ones left (a traced step grew 0.4 GiB over its passes; see `git show 7f3fe64:docs/performance.md`).

The collector's full pass visits every tracked object of the process, and most of them are the libraries'
(prefect, pydantic, transformers, torch: about 0.3 million after imports; in a test process holding a Prefect
harness and earlier tests' objects, a pass took ~1 s, a fifth of a 2-round flow test's time over its ~30
calls). `only_new_objects` (the curriculum flow's rounds, and every stage) collects once, then freezes what
exists (`gc.freeze`: the collector skips those objects) until it ends (`gc.unfreeze`), so each
`release_memory` inside visits what the run made since. What is frozen still frees itself by reference
counting; only a reference cycle among pre-existing objects that becomes garbage inside waits for the end.
Reentrant: an inner use (a stage inside the flow) changes nothing.

oneDNN (torch's CPU kernels for bf16 matmuls) caches up to 1024 compiled primitives, each holding its
scratch buffers, and a training round meets a new matmul shape with every packed sequence length: measured on
a standalone GRPO round of SmolLM2-135M, the cache kept 0.2 GiB after the round and raised the peak by 0.3 GiB.
`bound_onednn_cache` sets ONEDNN_PRIMITIVE_CACHE_CAPACITY to 16 unless the environment sets it (oneDNN reads
it when it first builds a primitive, so importing `models` early is enough): training and decoding ran at the
same speed with 16 as with 1024 (a decode step or a pass reuses a handful of shapes across its 30 layers);
0 (no cache) made training 4.5x slower.

ideep (torch's layer over oneDNN) keeps a second cache of its own: the matmul primitives it builds, per thread
(a thread_local LRU), up to LRU_CACHE_CAPACITY entries, 1024 unless set; each holds what the primitive built for
its shape. A bf16 training round meets hundreds of shapes, so the cache grew for the whole run, and its memory
is gone only when the thread ends: the 0.19 GiB that round 0's training left in use with no tensor alive
(`git show 7f3fe64:docs/performance.md`). `bound_onednn_cache` sets LRU_CACHE_CAPACITY to 16 too, unless the environment sets it:
a bf16 training of SmolLM2-135M over 30 sequence lengths left 154 MB of heap in use after it against 359 MB,
peaked 1.94 against 2.14 GiB and took 75 against 78 s; decoding ran at the same speed. Where bf16 matmuls do
not go through oneDNN (CPUs without AVX512 or AMX), neither cache is used and the caps change nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

ONEDNN_CACHE_CAPACITY = "16"
IDEEP_CACHE_CAPACITY = "16"  # ideep's per-thread cache of matmul primitives (LRU_CACHE_CAPACITY)


@functools.cache
def _trim():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return getattr(libc, "malloc_trim", None)


def trim_heap() -> None:
    """Return free heap pages to the OS where the C library can (glibc's malloc_trim); no garbage collection."""
    trim = _trim()
    if trim is not None:
        trim(0)


def release_memory() -> None:
    """Collect garbage and return free heap memory to the OS where the C library can (glibc); on a GPU, hand
    torch's cached blocks back too, so a vLLM engine waking on the same GPU finds the memory it had."""
    gc.collect()
    trim_heap()
    torch = sys.modules.get("torch")  # not imported here: a process without torch has nothing to free
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


_FROZEN = {"depth": 0}
_FROZEN_LOCK = threading.Lock()


@contextmanager
def only_new_objects() -> Iterator[None]:
    """Collect, then freeze every object that exists until the block ends, so the collector's passes inside
    visit only what the block made (module docstring). Reentrant: only the outermost block freezes."""
    with _FROZEN_LOCK:
        outermost = _FROZEN["depth"] == 0
        _FROZEN["depth"] += 1
        if outermost:
            gc.collect()
            gc.freeze()
    try:
        yield
    finally:
        with _FROZEN_LOCK:
            _FROZEN["depth"] -= 1
            if outermost:
                gc.unfreeze()


def bound_onednn_cache() -> None:
    """Cap oneDNN's primitive cache and ideep's per-thread one (see the module docstring), each unless the
    environment sets it (ONEDNN_PRIMITIVE_CACHE_CAPACITY, LRU_CACHE_CAPACITY)."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_CACHE_CAPACITY)
    os.environ.setdefault("LRU_CACHE_CAPACITY", IDEEP_CACHE_CAPACITY)
