"""Module forwards replaced for the length of a `with` block, per instance.

Training swaps some modules' forwards for memory-lean ones (models/training/recompute.py, models/training/grad_into.py) only
while its passes run: the replacement is set on the instance, and the instance's own forward, if it had one
(a backend's packed linear, models/hf/packed.py), is put back when the block ends, exception or not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch


@contextlib.contextmanager
def patched_forwards(pairs: Iterable[tuple[torch.nn.Module, Callable]]):
    """Within the block each module's forward is the one paired with it; afterwards what it was before."""
    pairs = list(pairs)
    before = [module.__dict__.get("forward") for module, _ in pairs]  # an instance's own forward, if it had one
    try:
        for module, forward in pairs:
            module.forward = forward
        yield
    finally:
        for (module, _), own in zip(pairs, before):
            if own is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = own
