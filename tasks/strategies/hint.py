"""hint_prefix (docs/algorithms.md §3.4): a too-hard or flat original with a reference solution gets a child that
shows the first words of that solution as a started answer; the hint is annealed away as the policy learns.

The child is the question plus "A solution starts like this: <the first max(1, floor(f * n)) of the solution's n
words> ...", with f = `refine.hint_fraction`. A hint child whose mean reward exceeds `refine.promote_threshold`
is promoted (strategy `promote`) to one revealing f - `refine.hint_anneal_step` of the root's solution, and once
less than 0.05 would remain, to the open question (the root itself). Every child passes the gate's checks
against the root question (it must not reveal the answer).
"""

from __future__ import annotations

import json

from tasks.strategies.base import PROMOTE, Parent, Proposal, RoundView, Strategy, child_row, register
from tasks.strategies.gate import LENGTHS, Lengths, check_child


def hint_child(parent: dict, fraction: float, run_id: str, round: int, root: dict | None = None,
               lengths: Lengths = LENGTHS) -> tuple[dict | None, str | None]:
    """hint_prefix: reveal the first `fraction` of the root's reference solution's words as a started answer.
    `parent` is the root itself, or (annealing) the hint child it replaces. (child, rejection reason)."""
    root = root or parent
    sol = root.get("solution")
    if not sol:
        return None, "unsupported: hint_prefix needs a reference solution"
    words = sol.split()
    k = max(1, int(len(words) * fraction))
    text = f"{root['text']}\nA solution starts like this: {' '.join(words[:k])} ..."
    child = child_row(parent, text, "hint_prefix", run_id, round, {"hint_fraction": fraction})
    child["solution"] = root.get("solution")
    return child, check_child(text, root["text"], root["answer"], min_chars=lengths.min_chars,
                              max_chars=lengths.max_chars)


def annealed_fraction(fraction: float, step: float = 0.1) -> float:
    """The next hint fraction after a promotion: f - step, and 0 (the open question) once less than 0.05 is left.

    >>> annealed_fraction(0.3), annealed_fraction(0.1), annealed_fraction(0.05)
    (0.2, 0.0, 0.0)
    """
    nxt = round(fraction - step, 6)
    return nxt if nxt >= 0.05 else 0.0


@register
class HintPrefix(Strategy):
    name = "hint_prefix"
    buckets = frozenset({"too_hard", "flat"})

    def slot(self, parent: Parent, view: RoundView) -> str | None:
        if parent.transform == "hint_prefix":
            return PROMOTE if view.solved(parent) else None
        return super().slot(parent, view) if parent.row.get("solution") else None

    def propose(self, parent: Parent, view: RoundView) -> list[Proposal]:
        cfg = view.cfg
        if parent.transform == "hint_prefix":  # annealing: f -> f - step -> ... -> the open question
            shown = json.loads(parent.row["meta"] or "{}").get("hint_fraction", cfg.hint_fraction)
            f = annealed_fraction(shown, cfg.hint_anneal_step)
            if f == 0:
                return [Proposal(parent.row, parent.root, gate="judged")]
            return [Proposal(parent.row, *hint_child(parent.row, f, view.run_id, view.round, parent.root,
                                                     view.lengths), gate="judged")]
        return [Proposal(parent.row, *hint_child(parent.row, cfg.hint_fraction, view.run_id, view.round,
                                                 lengths=view.lengths), gate="judged")]
