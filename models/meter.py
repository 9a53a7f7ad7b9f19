"""Counting generated tokens, by purpose, for compute-matched comparisons (docs/algorithms.md, budget).

Every place that asks a backend to generate calls `record(purpose, groups)` with what came back: `rollout`
(collect's groups, DAPO's discarded ones and screening's top-ups included), `screen` (screening's first
samples), `lope` (LoPE's resamples), `mcmc` (shaping's proposals), `eval` and `rescore`; `teacher` counts every answer refine and shape use, fresh or from the store's teacher
cache, by the tokens stored with it (tasks/strategies/teacher_calls.py, `meter_counts`). A completion counts
the token ids its backend reports (`Completion.n_tokens`), never the prompt. `metering()` opens a scope (a
context variable, so a stage's meter sees only its own calls, in the thread the stage runs in); outside any
scope `record` does nothing. The stage wrapper (tasks/stage.py) lands each stage's counts in
`generated_tokens`, in the stage's own commit; the rescore flow and `refinery eval` open no meter.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

PURPOSES = ("rollout", "screen", "lope", "teacher", "mcmc", "eval", "rescore")


@dataclass
class Meter:
    """Calls, completions and generated tokens per purpose."""

    counts: dict[str, list[int]] = field(default_factory=dict)

    def add(self, purpose: str, groups: Iterable[Iterable]) -> None:
        completions = [c for group in groups for c in group]
        self.add_counts(purpose, 1, len(completions), sum(c.n_tokens for c in completions))

    def add_counts(self, purpose: str, calls: int, completions: int, tokens: int) -> None:
        if purpose not in PURPOSES:
            raise ValueError(f"unknown generation purpose {purpose!r}: use one of {', '.join(PURPOSES)}")
        c = self.counts.setdefault(purpose, [0, 0, 0])
        c[0], c[1], c[2] = c[0] + calls, c[1] + completions, c[2] + tokens

    def rows(self) -> list[dict]:
        return [{"purpose": p, "calls": c[0], "completions": c[1], "tokens": c[2]}
                for p, c in sorted(self.counts.items())]


_METER: ContextVar[Meter | None] = ContextVar("refinery_meter", default=None)


@contextmanager
def metering() -> Iterator[Meter]:
    """A fresh meter for the calls made inside the block (nested blocks count apart)."""
    meter = Meter()
    token = _METER.set(meter)
    try:
        yield meter
    finally:
        _METER.reset(token)


def record(purpose: str, groups: list) -> list:
    """Count `groups` (lists of Completions) under `purpose` on the active meter; returns `groups`."""
    meter = _METER.get()
    if meter is not None:
        meter.add(purpose, groups)
    return groups


def meter_counts(purpose: str, calls: int, completions: int, tokens: int) -> None:
    """Count already-known totals under `purpose` on the active meter (the teacher's cached answers)."""
    meter = _METER.get()
    if meter is not None:
        meter.add_counts(purpose, calls, completions, tokens)
