"""Held-out evaluation's pure parts: the held-out split and the pass@k estimator (docs/algorithms.md).

The held-out set is fixed when the run starts (round 0's pool): a `fraction` of the root prompts, chosen by a
hash of (eval seed, root_id). pass@k is the unbiased estimator 1 - C(n - c, k) / C(n, k) (Chen et al. 2021).
"""

from __future__ import annotations

import hashlib
from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct.

    >>> pass_at_k(4, 0, 2), pass_at_k(4, 4, 2), round(pass_at_k(4, 1, 2), 4)
    (0.0, 1.0, 0.5)
    """
    if k > n:
        raise ValueError(f"pass@{k} needs at least k samples, got n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def heldout_roots(root_ids: list[str], fraction: float, seed: int) -> set[str]:
    """round(fraction * n) roots (at least one, and never all when n > 1), chosen by a seeded hash."""
    roots = sorted(set(root_ids))
    if not roots or fraction <= 0:
        return set()
    n = min(max(1, round(fraction * len(roots))), max(1, len(roots) - 1))
    ranked = sorted(roots, key=lambda r: hashlib.sha256(f"{seed}\x1f{r}".encode()).hexdigest())
    return set(ranked[:n])
