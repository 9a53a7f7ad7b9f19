"""The refine stage's record of a round: one `refinements` row per attempt, the new children, and the slots
each cap has taken (docs/algorithms.md §3.1).

Choices, and why:
- A child accepted twice in one round (two strategies, or two parents, made the same text) is kept once, and
  the second attempt leaves no row.
- A child already in this run's pool is rejected as `duplicate`, except a promotion, whose child may be the
  root question coming back; a child another run already made is reused as it is (no second prompts row).
- A child that is a held-out prompt of the run or a twin of one (tasks/core/heldout.py `twin_key`: the same
  numbers and answer, "2 * 5" beside a held-out "5 * 2") is rejected as `held out`, before anything else: the
  strategies that make new problems (soften, harden) can reach the evaluation's prompts, and training on them
  would score the curriculum on what it trained on.
- The summary counts gate rejections per stable category (`split_part(reason, ':', 1)` in SQL); the rows the
  gate never judged (`teacher unavailable`, `empty answer`) are not among them.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

import polars as pl
import pyarrow as pa

from tasks.core.heldout import twin_key
from tasks.strategies.base import PROMOTE, Proposal
from tasks.strategies.gate import NOT_JUDGED, reason_category

REFINEMENTS = pa.schema([("run_id", pa.string()), ("round", pa.int32()), ("parent_id", pa.string()),
                         ("child_id", pa.string()), ("strategy", pa.string()), ("accepted", pa.bool_()),
                         ("reason", pa.string()), ("teacher_call", pa.string())])


class Ledger:
    """The round's refinements rows and new children, and the slots each cap has taken: at most `per_strategy`
    per strategy (promotions are strategy PROMOTE) and `in_all` over all of them."""

    def __init__(self, per_strategy: int, in_all: int, known: set[str], in_pool: set[str],
                 held_twins: frozenset[str] = frozenset()):
        self.per_strategy, self.in_all, self.known, self.in_pool = per_strategy, in_all, known, in_pool
        self.held_twins = held_twins  # twin keys of the run's held-out prompts
        self.rows: list[dict] = []
        self.children: list[dict] = []
        self.used: dict[str, int] = {}

    def room(self, slot: str) -> bool:
        return self.used.get(slot, 0) < self.per_strategy and sum(self.used.values()) < self.in_all

    def take(self, slot: str, n: int = 1) -> None:
        self.used[slot] = self.used.get(slot, 0) + n

    def record(self, slot: str, p: Proposal, call: dict | None = None) -> None:
        """One refinements row for the judged proposal `p` under strategy `slot`, taking one of its slots."""
        child, reason = p.child, p.reason
        accepted = child is not None and reason is None
        if accepted and any(c["prompt_id"] == child["prompt_id"] for c in self.children):
            return
        if accepted and slot != PROMOTE and twin_key(child["text"], child["answer"]) in self.held_twins:
            accepted, reason = False, "held out: the child is a held-out prompt of this run, or its twin"
        elif accepted and child["prompt_id"] in self.in_pool and slot != PROMOTE:
            accepted, reason = False, "duplicate: already in this run's pool"
        self.rows.append({"parent_id": p.parent["prompt_id"], "child_id": child["prompt_id"] if child else None,
                          "strategy": slot, "accepted": accepted, "reason": reason or (p.note if accepted else None),
                          "teacher_call": json.dumps(call) if call else None})
        if accepted and child["prompt_id"] not in self.known:
            self.children.append(child)
        self.take(slot)

    def tables(self, run_id: str, round: int) -> dict[str, pa.Table]:
        """What the stage commits: `refinements`, and `prompts` when a child is new."""
        out = {"refinements": pa.Table.from_pylist([{"run_id": run_id, "round": round, **r} for r in self.rows],
                                                   schema=REFINEMENTS)}
        if self.children:
            now = datetime.now(UTC)
            out["prompts"] = pa.Table.from_pylist([{**c, "created_at": now} for c in self.children])
        return out

    def summary(self) -> dict:
        """Children, rows, rows per strategy (accepted or not) and gate rejections per category."""
        frame = pl.DataFrame(self.rows, schema={"strategy": pl.String, "accepted": pl.Boolean}) if self.rows else None
        counts = ({f"{k}{'' if a else ' (rejected)'}": v for k, a, v in
                   frame.group_by("strategy", "accepted").len().iter_rows()} if frame is not None else {})
        rejections: dict[str, int] = {}
        for r in self.rows:
            category = reason_category(r["reason"]) if not r["accepted"] and r["reason"] else None
            if category and category not in NOT_JUDGED:
                rejections[category] = rejections.get(category, 0) + 1
        return {"children": len(self.children), "refinements": len(self.rows), "by_strategy": counts,
                "rejections": dict(sorted(rejections.items()))}
