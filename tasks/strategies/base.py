"""The `Strategy` protocol every refinement strategy implements, and the registry that finds them by name.

A strategy is a class in its own file under tasks/strategies/, decorated with `@register`; its `name` is one of
`RefineConfig.strategies`' choices (tasks/refine.py). The refine stage asks it, for each scored parent of the
round, which cap the parent would take a slot of (`slot`: its own name, `PROMOTE`, or None when it does not
apply), and if the cap has room, for children (`propose`). A `Proposal` is a child (or the reason none could be
made) plus what the gate still has to check (`gate`); a child that needs the teacher first carries an `Ask`
(the call's cache key and prompt) and a continuation that makes the child from the `Answer`, so the stage asks
the teacher for all of a round's children at once (docs/architecture.md shows a complete example).

Choices, and why:
- Strategies read the refine settings through `Settings`, the fields they use, which `RefineConfig` has: a
  protocol, so this folder never imports the stage that imports it.
- `Proposal.gate` says who judges a child: "child" (the stage runs the checks every child passes:
  `gate.check_child` against the parent), "rewrite" (the stage also runs the batched `RewriteGate` over all of the
  round's free-text rewrites at once), or "judged" (the maker ran the checks its child needs, e.g. a ladder
  rung's options, and `reason` is the verdict).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Protocol

from tasks.core.ids import prompt_id as content_id
from tasks.core.registry import Registry
from tasks.strategies.gate import Lengths
from tasks.strategies.teacher_calls import Teacher

PROMOTE = "promote"  # the refinements.strategy of a promotion (one step harder), with a cap of its own


class Settings(Protocol):
    """The refine settings strategies read (each is a `RefineConfig` field, described there)."""

    promote_threshold: float
    hint_fraction: float
    hint_anneal_step: float
    teacher_distractors: bool
    teacher_attempts: int
    gate_min_chars: int
    gate_max_chars: int


@dataclass(frozen=True)
class Parent:
    """A scored prompt of the round, as a strategy sees it: its row, its lineage's root row (itself for an
    original), its bucket and the mean reward of the policy's own samples."""

    row: dict
    root: dict
    bucket: str
    mean_reward: float

    @property
    def id(self) -> str:
        return self.row["prompt_id"]

    @property
    def transform(self) -> str:
        return self.row["transform"]


@dataclass(frozen=True)
class RoundView:
    """What a strategy may read of the round besides the parent."""

    run_id: str
    round: int
    cfg: Settings
    teacher: Teacher | None = None  # None: no teacher is configured or wanted this round
    attempts: Mapping[str, list[dict]] = field(default_factory=dict)  # prompt id -> the policy's own rollouts

    def solved(self, parent: Parent) -> bool:
        """Is the parent's mean reward above the promotion threshold?"""
        return parent.mean_reward > self.cfg.promote_threshold

    @property
    def lengths(self) -> Lengths:
        return Lengths(self.cfg.gate_min_chars, self.cfg.gate_max_chars)

    def child(self, parent: dict, text: str, transform: str, **kwargs: object) -> dict:
        """`child_row` of this round."""
        return child_row(parent, text, transform, self.run_id, self.round, **kwargs)


@dataclass(frozen=True)
class Answer:
    """The teacher's answer to one `Ask`: its text, or the one-line reason it failed."""

    key: str
    teacher: str
    response: str | None  # None: the call failed (`error` says why)
    error: str | None = None
    reused: bool = False  # answered from `teacher_calls`, not asked now

    def record(self) -> dict:
        """The call as `refinements.teacher_call` stores it (JSON)."""
        if self.error is not None:
            return {"key": self.key, "teacher": self.teacher, "response": None, "reused": False, "error": self.error}
        return {"key": self.key, "teacher": self.teacher, "response": self.response, "reused": self.reused}


@dataclass(frozen=True)
class Ask:
    """A teacher call a proposal waits for: its cache key, its prompt, and what makes the proposal from the
    answer."""

    key: str
    payload: str
    then: Callable[[Answer], Proposal]


@dataclass(frozen=True)
class Proposal:
    """A child of `parent` (None: nothing could be made, and `reason` says why), or a teacher call to make it."""

    parent: dict
    child: dict | None = None
    reason: str | None = None  # why the child is rejected, when the maker already knows
    gate: Literal["child", "rewrite", "judged"] = "child"
    ask: Ask | None = None
    note: str | None = None  # the reason column of an accepted row (a teacher fallback)


class Strategy(Protocol):
    """A refinement strategy (see the module docstring). Subclassing it gives the defaults below."""

    name: ClassVar[str]  # its name in RefineConfig.strategies, and refinements.strategy of its children
    buckets: ClassVar[frozenset[str]] = frozenset()  # the buckets of originals it refines

    def slot(self, parent: Parent, view: RoundView) -> str | None:
        """The cap this parent takes a slot of (the strategy's name, or PROMOTE), or None: not for this
        parent. By default: originals of `buckets`."""
        return self.name if parent.transform == "original" and parent.bucket in self.buckets else None

    def wants_teacher(self, cfg: Settings) -> bool:
        """Does it ask the teacher under these settings (the stage loads one only if some strategy does)?"""
        return False

    def propose(self, parent: Parent, view: RoundView) -> list[Proposal]:
        """Children of `parent` (usually one); each takes a slot of `slot(parent, view)`'s cap."""
        ...


REGISTRY: Registry[Strategy] = Registry("refinement strategy", "refinement strategies", "tasks/strategies/")
register = REGISTRY.register  # class decorator: the strategy `cls.name` is `cls()` from now on (one per name)
strategy = REGISTRY.named  # the registered strategy `name`, or a one-line error naming what is registered


def child_row(parent: dict, text: str, transform: str, run_id: str, round: int, meta_extra: dict | None = None,
              answer: str | None = None, params: str | None = None, meta_from: dict | None = None) -> dict:
    """A prompts row for a child of `parent`. Its meta is `meta_from`'s (default: the parent's) updated by
    `meta_extra`; its solution is the parent's while the answer is."""
    answer = parent["answer"] if answer is None else answer
    base = parent if meta_from is None else meta_from
    meta = json.loads(base["meta"]) if base.get("meta") else {}
    meta.update(meta_extra or {})
    return {"prompt_id": content_id(text, answer, parent["source"]), "text": text, "answer": answer,
            "solution": None if answer != parent["answer"] else parent.get("solution"),
            "source": parent["source"], "params": params or parent.get("params"), "parent_id": parent["prompt_id"],
            "root_id": parent["root_id"], "transform": transform, "run_id": run_id, "round": round,
            "meta": json.dumps(meta, sort_keys=True)}
