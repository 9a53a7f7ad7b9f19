"""Generate, then verify: the one sampling pass that collect, rescore and evaluation share, and the one place
a `Sampling` is built from config.

`generate_verified` renders each prompt's chat messages with the backend's template, samples n completions
per prompt with keyed seeds (each prompt's draws depend on (sampling seed, prompt_id) alone, not on the batch:
tasks/core/seeds.py `row_seeds`), counts them under a generation purpose on the running stage's meter
(models/meter.py: `rollout`, `rescore`, `eval`), and checks each completion against its prompt's answer
(tasks/core/verdicts.py). The callers differ only in their messages (few-shot context for collect, the plain
question and instruction for rescore and evaluation: `plain_messages`), their purpose and whether a progress
bar shows (`label`). `seconds` is the rendering and generation time, not the verification.

`config_sampling` is the sampling of a config section: its temperature, top_p and longest completion, seeded
for round r as seed * 1000 + r (tasks/core/seeds.py `round_seed`), plus an offset that keeps a rescore's draws
apart from every round's; evaluation passes its own temperature, top_p 1 and its seed, and keys by the
checkpoint version instead of the round. The section is read by attribute (`SamplingSection`), so this module
imports no config class and tasks/sampling/rollouts.py can import it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Protocol

import polars as pl

from models.backend import Backend, Completion, Sampling
from models.meter import record
from tasks.core.fewshot import ask
from tasks.core.rewards import RewardConfig, Verdict
from tasks.core.seeds import round_seed, row_seeds
from tasks.core.verdicts import verdicts
from tasks.reporting.progress import progress_reporter


class SamplingSection(Protocol):
    """What `config_sampling` reads of a config section (RolloutConfig has it)."""

    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int


def config_sampling(cfg: SamplingSection, round: int, *, offset: int = 0, seed: int | None = None,
                    temperature: float | None = None, top_p: float | None = None) -> Sampling:
    """The section's sampling for round `round` (seed * 1000 + round, plus `offset`); `seed`, `temperature`
    and `top_p` replace the section's where given.

    >>> from types import SimpleNamespace as S
    >>> config_sampling(S(temperature=0.7, top_p=0.9, max_new_tokens=64, seed=2), 3)
    Sampling(temperature=0.7, top_p=0.9, max_new_tokens=64, seed=2003)
    >>> config_sampling(S(temperature=0.7, top_p=0.9, max_new_tokens=64, seed=2), 1, seed=5, temperature=0.0,
    ...                 top_p=1.0, offset=10)
    Sampling(temperature=0.0, top_p=1.0, max_new_tokens=64, seed=5011)
    """
    return Sampling(cfg.temperature if temperature is None else temperature, cfg.top_p if top_p is None else top_p,
                    cfg.max_new_tokens, round_seed(cfg.seed if seed is None else seed, round) + offset)


def plain_messages(prompts: pl.DataFrame, instruction: str) -> list[list[dict]]:
    """Each prompt's question with the instruction, as one user turn (no few-shot context, no prefix)."""
    return [[ask(text, instruction)] for text in prompts["text"]]


@dataclass
class Verified:
    """One generate-then-verify pass, in the order of the prompts' rows."""

    rendered: list[str]  # the prompt text the model saw
    groups: list[list[Completion]]
    checked: list[list[Verdict]]
    seconds: float  # rendering and generation

    @property
    def n_tokens(self) -> int:
        return sum(c.n_tokens for g in self.groups for c in g)

    @property
    def timeouts(self) -> int:
        return sum(v.timed_out for vs in self.checked for v in vs)


def generate_verified(backend: Backend, prompts: pl.DataFrame, messages: list[list[dict]], n: int,
                      sampling: Sampling, reward_cfg: RewardConfig, purpose: str, label: str | None = None,
                      on_progress: Callable[[int], None] | None = None) -> Verified:
    """n completions for each of `prompts` (prompt_id, answer, ...; `messages` holds each one's chat turns),
    seeded per prompt id, counted under `purpose`, verified. With `label`, a progress bar (and, in a Prefect
    run, a progress artifact) of that name counts the completions; `on_progress(k)` hears of each k done."""
    t0 = time.perf_counter()
    rendered = [backend.render(m) for m in messages]
    bar = progress_reporter(label, len(rendered) * n) if label else nullcontext(None)
    with bar as advance:
        def progress(k: int) -> None:
            if advance is not None:
                advance(k)
            if on_progress is not None:
                on_progress(k)

        groups = record(purpose, backend.generate(rendered, n, sampling,
                                                  progress=progress if label or on_progress else None,
                                                  row_seeds=row_seeds(sampling.seed, prompts["prompt_id"].to_list())))
    seconds = time.perf_counter() - t0
    return Verified(rendered, groups, verdicts(prompts, groups, reward_cfg), seconds)
