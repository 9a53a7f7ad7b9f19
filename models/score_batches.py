"""Batches of scoring rows with little padding (models/hf.py `score_ids`).

A forward over right-padded rows costs about rows x the longest row's tokens. Scoring calls mix lengths:
MCMC shaping scores π(s' | x, y_<i) on the plain prompt next to q(s | c, y_<i) on a prompt that also holds
the reference solution (about twice as long), and one batch of both padded every short row to the long
ones' width. Here rows, shortest first, are cut into batches of at most `max_rows`, and a new batch starts
when the padded tokens would exceed (1 + `slack`) x the batch's own tokens. A batch costs one more forward
call's fixed overhead (tens of milliseconds for the 135M model on CPU), less than the padding it saves
once rows differ by a quarter of their length.
"""

from __future__ import annotations

PAD_SLACK = 0.25  # padded tokens allowed above a batch's own tokens before a new batch starts


def padded_batches(lengths: list[int], max_rows: int, slack: float = PAD_SLACK) -> list[list[int]]:
    """Indices into `lengths`, shortest first, cut into batches of at most `max_rows` whose padded size
    (rows x the longest) stays within (1 + slack) x their tokens, except a batch of one row.

    >>> padded_batches([10, 100, 12, 110, 11], 32)
    [[0, 4, 2], [1, 3]]
    >>> padded_batches([5, 5, 5], 2)
    [[0, 1], [2]]
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    batches: list[list[int]] = []
    batch: list[int] = []
    tokens = 0
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        n = lengths[i]  # the longest so far: the batch's width if it joins
        if batch and (len(batch) == max_rows or (len(batch) + 1) * n > (1 + slack) * (tokens + n)):
            batches.append(batch)
            batch, tokens = [], 0
        batch.append(i)
        tokens += n
    if batch:
        batches.append(batch)
    return batches
