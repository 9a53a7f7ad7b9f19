"""The budget governor (issue 50, item 5; the design's §4b rule): every component that spends generated tokens on
top of plain rollouts earns its budget round by round, or is throttled to its minimum.

Yield. For round r and component c, yield_c = training rows c made usable per 1,000 tokens c generated:
- `rollout` (the baseline): rows of informative groups (groups of the policy's own samples whose rewards differ:
  G rows each) per 1k collect tokens of purposes `rollout` and `screen` (screening's samples, screened-out ones
  included, are what the baseline's groups cost; tasks/sampling/screening.py);
- `lope`: rows of the groups LoPE rescued (an all-fail group with a replaced rollout: G rows each) per 1k `lope`
  tokens;
- `shape`: verified shaped traces (one SFT row each) per 1k tokens of the shape stage (`mcmc` proposals and the
  teacher's start traces);
- `refine`: accepted refinements (each a prompt that can yield rows next round) per 1k tokens of the refine
  stage (the teacher's);
- `topup`: screening's top-ups on the posterior's word (a unanimous screen the pass-rate posterior still
  expected to turn mixed: tasks/core/screening.py): rows of those groups that came out mixed (G each) per 1k
  tokens of their top-up samples (the screens were spent either way). It is the posterior's calibration paying
  in tokens: an over-confident posterior tops up groups that stay all-fail. Throttled, a round tops up at most
  one such screen (`rollout.screen_posterior_topups`); mixed screens are always topped up.
A component that generated nothing in a round is `idle` there: no yield, no verdict.

Rule. A component whose yield stays below the baseline's for 2 consecutive measured rounds (`patience`) is
throttled to its minimum (`COMPONENTS`: the config field and the value it is held at); a throttled one that is
above the baseline in 1 measured round is restored to its configured value. A throttled component still runs at
its minimum, so it keeps being measured and can earn its budget back. The decision for round r reads rounds
before r only, so it is made before round r generates anything and is the same on resume (it lands in
`governor`, one row per component and round, with its figures).

Choices: rows, not groups, are the unit, so a group of G and a shaped trace compare at what they add to a
training step; the minimum is 1 unit rather than 0, so that recovery is observable; `refine`'s ladder and
numeric strategies generate nothing and never count against it. Screening itself and its top-ups of mixed
screens are part of the baseline, not components: a screen is what tells a mixed prompt from a unanimous one,
and a mixed screen's top-up is informative by construction; only the posterior's top-ups are a bet.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from models.config import Section


@dataclass(frozen=True)
class Component:
    name: str
    field: str  # section.field the governor holds at `minimum` while the component is throttled
    minimum: int


COMPONENTS = (Component("lope", "rollout.lope_max_groups", 1), Component("shape", "shape.max_traces", 1),
              Component("refine", "refine.max_children", 1),
              Component("topup", "rollout.screen_posterior_topups", 1))


class GovernorConfig(Section):
    """The budget governor: components that spend generated tokens earn their budget (tasks/core/governor.py)."""

    enabled: bool = Field(True, description="throttle a component whose training rows per 1k generated tokens "
                          "stay below plain rollouts' for `patience` rounds, and restore it when it recovers")
    patience: int = Field(2, ge=1, le=100, description="consecutive measured rounds below the baseline before "
                          "a component is throttled")


@dataclass(frozen=True)
class Measure:
    """One component's figures in one round."""

    round: int
    tokens: int
    rows: float

    @property
    def yield_per_1k(self) -> float | None:
        return 1000.0 * self.rows / self.tokens if self.tokens > 0 else None


def decide(history: list[tuple[Measure, Measure]], throttled: bool, patience: int = 2) -> tuple[bool, str, int]:
    """(throttled from now, decision, measured rounds below the baseline in a row) from a component's measured
    rounds, oldest first, each (its measure, the baseline's), and whether it is throttled now. Decisions:
    `throttle`, `restore`, `keep` (no change), `idle` (the newest round measured nothing: no change).

    >>> m = lambda r, y: (Measure(r, 1000, y), Measure(r, 1000, 10.0))
    >>> decide([m(0, 2.0), m(1, 3.0)], False), decide([m(0, 2.0), m(1, 30.0)], False), decide([m(0, 2.0)], False)
    ((True, 'throttle', 2), (False, 'keep', 0), (False, 'keep', 1))
    >>> decide([m(0, 2.0), m(1, 30.0)], True), decide([m(0, 2.0), m(1, 3.0)], True)
    ((False, 'restore', 0), (True, 'keep', 2))
    >>> decide([m(0, 2.0), (Measure(1, 0, 0), Measure(1, 1000, 10.0))], True)
    (True, 'idle', 1)
    """
    below = 0
    for mine, base in history:
        y, b = mine.yield_per_1k, base.yield_per_1k
        if y is None or b is None:
            continue  # an idle round neither extends nor breaks a streak
        below = below + 1 if y < b else 0
    if not history or history[-1][0].yield_per_1k is None or history[-1][1].yield_per_1k is None:
        return throttled, "idle", below
    if throttled:
        return (False, "restore", 0) if below == 0 else (True, "keep", below)
    if below >= patience:
        return True, "throttle", below
    return False, "keep", below
