"""DAPO dynamic sampling (Yu et al. 2025, arXiv 2503.14476 §3.2; docs/algorithms.md §7), the `dapo_filter` baseline.

A group whose G rewards are all equal (accuracy 0 or 1) has zero advantage everywhere and gives GRPO no
gradient. DAPO therefore over-samples: it generates groups for more prompts than the batch needs, drops the
zero-variance ones, and keeps sampling until the batch holds B groups with non-zero variance. This module is
that loop, independent of any backend: `dynamic_sampling` takes the round's candidate queue and a
`generate(items, k)` callable, and returns what was kept and what was discarded, and why.

Choices, and why:
- Within the round, in generation batches. Batch 1 draws ceil(oversample * B) prompts (the select stage
  draws them: `tasks/select.py`); each refill draws ceil(oversample * (B - kept)) more from the queue, i.e.
  it is sized by the groups still missing. verl's recipe (recipe/dapo: gen batch = 3 x train batch, at most
  10 generation batches) draws fixed-size generation batches instead; sizing refills by the deficit spends
  fewer rollouts on surplus groups that would be thrown away, which only makes the baseline cheaper.
- The factor adapts (`adaptive_oversample`): 1 / the run's last round's informative ratio (groups with reward
  variance over groups generated, discards included), at least 1 and capped at 3; round 0, with nothing to
  measure, uses the configured `dapo_oversample`. A fixed 3x over-samples a pool that is 80% informative by
  2.4x and throws the surplus away; sizing by the last ratio makes the baseline about as cheap as it can be.
- The cap: at most `max_batches` generation batches, the first included (verl's max_num_gen_batches). A
  batch still short then trains on the groups it has (verl raises instead); the shortfall is reported
  (`short`, `cap_hit`), and so is running out of candidates (`exhausted`).
- Variance is the population spread of the group's rewards, more than `tol` (1e-6, the trainer's zero-variance threshold);
  with binary rewards that is "accuracy neither 0 nor 1". A group of constant partial credit is dropped too
  (it has no gradient either); a group of wrong answers whose format rewards differ is kept (it has one).
- When a generation batch yields more varied groups than the batch still needs, the first ones in queue order
  are kept and the rest discarded as `surplus` (DAPO truncates to the batch size too).
- The same loop runs screening then top-up (tasks/core/screening.py, tasks/sampling/screening.py): a
  `verdict` callable names the groups that cannot be kept whatever their rewards (`screened_out`; a screen
  left unfinished because the batch was full is `surplus`).
- Every discarded group was generated and counts against the baseline's rollout budget: the collect stage
  lands it in `discarded_rollouts` (with its tokens), never in `rollouts`, so it is no GRPO row and moves no
  prompt in the pool; what it shows about its prompt is read (score's screened-out bucket, the pass-rate
  posterior, shaping's unsolved prompts: tasks/shape.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

T = TypeVar("T")

ZERO_VARIANCE = "zero_variance"  # every reward of the group equal: no gradient
SURPLUS = "surplus"  # varied, but the batch was already full
SCREENED_OUT = "screened_out"  # screening: a unanimous screen the posterior did not top up (tasks/core/screening.py)
MAX_OVERSAMPLE = 3.0  # the adaptive factor's cap (DAPO's recipe: a fixed 3)


def first_batch_size(batch: int, oversample: float) -> int:
    """Prompts in the first generation batch: ceil(oversample * B) (a hair below an integer rounds down)."""
    return math.ceil(oversample * batch - 1e-9)


def refill_size(batch: int, kept: int, oversample: float) -> int:
    """Prompts in a refill: ceil(oversample * (B - kept)), the groups still missing, over-sampled again."""
    return math.ceil(oversample * (batch - kept) - 1e-9)


def adaptive_oversample(informative_ratio: float | None, first: float, cap: float = MAX_OVERSAMPLE) -> float:
    """dapo_filter's over-sampling factor: 1 / (the run's last round's informative ratio), between 1 and `cap`;
    `first` (the configured factor) when there is no earlier round to measure.

    >>> adaptive_oversample(None, 3.0), adaptive_oversample(0.5, 3.0), adaptive_oversample(0.1, 3.0)
    (3.0, 2.0, 3.0)
    >>> adaptive_oversample(0.0, 1.5), adaptive_oversample(1.0, 3.0)
    (3.0, 1.0)
    """
    if informative_ratio is None:
        return first
    if informative_ratio <= 0:
        return cap
    return min(cap, max(1.0, 1.0 / informative_ratio))


def has_variance(rewards: Sequence[float], tol: float = 1e-6) -> bool:
    """Whether a group's rewards have a population standard deviation above `tol` (one sample has none)."""
    return len(rewards) > 1 and float(np.std(np.asarray(rewards, dtype=float))) > tol


def draw_order(ids: Sequence[str], seed: int) -> list[str]:
    """The candidates in the order dynamic sampling draws them: a seeded uniform permutation of `ids`."""
    order = np.random.default_rng(seed).permutation(len(ids))
    return [ids[i] for i in order]


@dataclass
class Drawn(Generic[T]):
    """One generated group: the queue item, what `generate` returned for it, and the generation batch (0-based)."""

    item: T
    group: Any
    gen_batch: int
    varied: bool
    reason: str | None = None  # why it was discarded; None when kept


@dataclass
class DynamicSample(Generic[T]):
    kept: list[Drawn[T]] = field(default_factory=list)  # B varied groups at most (unless overflow), in queue order
    discarded: list[Drawn[T]] = field(default_factory=list)
    batches: int = 0  # generation batches run
    batch: int = 0  # B, the batch size asked for
    cap_hit: bool = False  # short, and the cap stopped the refills while candidates remained
    exhausted: bool = False  # short, and every candidate was generated

    @property
    def generated(self) -> int:
        return len(self.kept) + len(self.discarded)

    @property
    def short(self) -> int:
        """Groups the batch lacks (0 once B are kept, or more under `overflow`)."""
        return max(self.batch - len(self.kept), 0)


def dynamic_sampling(queue: Sequence[T], batch: int, oversample: float, max_batches: int,
                     generate: Callable[[list[T], int], Sequence[Any]],
                     rewards: Callable[[Any], Sequence[float]], tol: float = 1e-6,
                     first_size: int | None = None,
                     verdict: Callable[[Any], str | None] | None = None,
                     overflow: bool = False) -> DynamicSample[T]:
    """Generate groups for `queue` in order, batch by batch, until B varied groups are kept, the cap of
    `max_batches` generation batches is reached, or the queue runs out.

    `generate(items, k)` returns one group per item for generation batch k; `rewards(group)` its rewards.
    `first_size` overrides the first batch's size (the select stage may have drawn it already). `verdict(group)`,
    when given, says before the variance test why a group cannot be kept (screening: `screened_out`, or
    `surplus` for a screen left unfinished), or None to judge it by its variance as usual. `overflow` keeps
    every varied group of the batch that reaches B (screening decides itself how many it completes: a mixed
    screen's top-up is the cheapest informative group there is); without it the ones past B are `surplus`."""
    if batch < 1:
        raise ValueError(f"dynamic sampling: batch size must be >= 1, got {batch}")
    if oversample < 1:
        raise ValueError(f"dynamic sampling: over-sampling factor must be >= 1, got {oversample}")
    if max_batches < 1:
        raise ValueError(f"dynamic sampling: the cap on generation batches must be >= 1, got {max_batches}")
    if first_size is not None and first_size < 1:
        raise ValueError(f"dynamic sampling: the first generation batch must hold >= 1 prompt, got {first_size}")
    out: DynamicSample[T] = DynamicSample(batch=batch)
    pos = 0
    while len(out.kept) < batch and out.batches < max_batches and pos < len(queue):
        k = out.batches
        if k == 0:
            size = first_size if first_size is not None else first_batch_size(batch, oversample)
        else:
            size = refill_size(batch, len(out.kept), oversample)
        items = list(queue[pos:pos + size])
        pos += len(items)
        groups = list(generate(items, k))
        if len(groups) != len(items):
            raise ValueError(f"dynamic sampling: generation batch {k + 1} returned {len(groups)} groups for "
                             f"{len(items)} prompts")
        out.batches += 1
        for item, group in zip(items, groups):
            why = verdict(group) if verdict is not None else None
            varied = why is None and has_variance(rewards(group), tol)
            drawn = Drawn(item, group, k, varied)
            if varied and (overflow or len(out.kept) < batch):
                out.kept.append(drawn)
            else:
                drawn.reason = why or (SURPLUS if varied else ZERO_VARIANCE)
                out.discarded.append(drawn)
    if out.short:
        out.exhausted = pos >= len(queue)
        out.cap_hit = not out.exhausted
    return out
