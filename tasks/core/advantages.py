"""GRPO's group-relative advantages (docs/algorithms.md §6): each sample's reward against its group's, the
group's standard deviation dividing (Dr.GRPO: not). A group whose rewards are all equal carries no gradient and
is not trained on (None)."""

from __future__ import annotations


def group_advantages(rewards: list[float], scale_std: bool = True, eps: float = 1e-6) -> list[float] | None:
    """(r - mean) / (std + 1e-6) per group, or None for a zero-variance group.

    >>> group_advantages([1.0, 0.0, 0.0, 1.0])
    [0.999998000004, -0.999998000004, -0.999998000004, 0.999998000004]
    >>> group_advantages([0.5, 0.5]) is None, group_advantages([1.0, 0.0], scale_std=False)
    (True, [0.5, -0.5])
    """
    n = len(rewards)
    mean = sum(rewards) / n
    std = (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5
    if std <= eps:
        return None
    return [(r - mean) / (std + 1e-6) if scale_std else r - mean for r in rewards]
