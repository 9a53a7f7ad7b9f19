"""Seeds derived from a config seed, in one place.

Round r of a stage whose config seed is s draws with `round_seed(s, r)` = s * 1000 + r: distinct per round for
up to 1000 rounds per seed, and the same for a resumed round, so a resume samples what the first try would
have. Evaluation keys its draws by policy version instead of round (`round_seed(s, version)`), so a version
is scored on the same samples whichever round evaluates it.
"""

from __future__ import annotations

from tasks.core.ids import seed_of

ROUND_STRIDE = 1000


def round_seed(seed: int, round: int) -> int:
    """The seed of round (or version) `round` for config seed `seed`.

    >>> round_seed(0, 3), round_seed(2, 3)
    (3, 2003)
    """
    return seed * ROUND_STRIDE + round


def row_seeds(seed: int, keys: list[str]) -> list[int]:
    """One 32-bit sampling seed per row key (a prompt id, or a prompt id and a LoPE prefix), a pure function of
    (seed, key): a row draws the same tokens whichever batch, shard or worker generates it (keyed sampling,
    models/hf/decoding.py), so a stage sharded over workers writes exactly the rows one process writes.

    >>> row_seeds(3, ["a", "b"]) == row_seeds(3, ["a", "b"]), row_seeds(3, ["a"]) == row_seeds(4, ["a"])
    (True, False)
    """
    return [seed_of(f"{seed}:{k}") for k in keys]
