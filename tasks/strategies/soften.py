"""soften (docs/algorithms.md §3.5; issue 50 item 4): a too-hard arithmetic prompt gets an easier sibling one
difficulty step down, made from its own numbers; the lineage climbs back as the policy passes each rung.

The step, on the item's expression (reasoning-gym's `metadata["expression"]`: products, chain_sum,
basic_arithmetic; + - * and integers only):
- while some operand has two or more digits, the widest one (the last on a tie) loses its leading digit:
  `42 * 25` -> `42 * 5` -> `2 * 5`, `57 + 87` -> `57 + 7` -> `7 + 7`; where that would leave zero, a factor of
  one (`12 * 21` -> `12 * 1` would pose its answer) or drop more than one digit (`20`, `205`), the last digit goes
  instead (`2`, `20`);
- once every operand has one digit, the last term goes (`3 + 4 + 5` -> `3 + 4`);
- at two one-digit terms there is no step down (`unsupported: at the minimum`). A parent soften cannot step
  down (at the minimum, another task, no expression once in its text) takes no soften slot (`can_soften`): a
  too-hard rung at the minimum would otherwise be proposed, rejected and charged a slot every round.
So 2-digit x 2-digit products step to 2-digit x 1-digit (a partial product of the worked solution's long
multiplication) and then to the times table: the intermediate rung is the one a 135M policy can be at 25-75% on.
Keeping the widest operand's trailing digits keeps the child a step of the parent's own worked solution; a fresh
draw from the generator one `max_digits` lower (what `harden` does upwards) would skip the mixed-width rung,
since reasoning-gym draws every operand from the same digit range.

Choices, and why:
- The child is the parent's question with the expression replaced (the expression must occur once in the text),
  its answer is the new expression's exact value (tasks/core/worked_solutions.py `value_of`), and its meta records
  the rung: `expression`, `num_terms`, `num_digits`, `level` (the operands' widths, e.g. `digits 2,1`, so the
  pass-rate model pools rungs of one shape: tasks/core/passrate.py), `soften_depth` (steps below the root). It has
  its worked solution, so hint prefixes and shaping can use it. It is a new problem with a new answer, so the
  gate's leak check runs against the child's own answer (`gate = "judged"` after `check_child`).
- Routing: a too-hard original or a too-hard rung is softened one step (the rung it replaces retires:
  tasks/core/pool_rules.py; an original moves to reserve as any non-informative original does). A rung whose mean
  reward exceeds `refine.promote_threshold` is promoted (strategy `promote`) to the rung one step up, rebuilt
  from the root by the same deterministic steps, and at depth 1 to the root itself, which comes back active.
- The step is deterministic: a root that is still too hard after its rung was promoted back re-poses that rung,
  which the ledger rejects as `duplicate` (the root then stays in reserve); no lineage cycles.
"""

from __future__ import annotations

import json
import re

from tasks.core.worked_solutions import NoSolution, value_of, worked_solution
from tasks.strategies.base import PROMOTE, Parent, Proposal, RoundView, Strategy, child_row, register
from tasks.strategies.gate import LENGTHS, Lengths, check_child

SOFTENED = ("products", "chain_sum", "basic_arithmetic")  # rg tasks whose items carry a plain expression
_PLAIN = re.compile(r"[\d\s+\-*]+")
_NUMBER = re.compile(r"\d+")


def soften_expression(expression: str) -> str | None:
    """The expression one step easier (module docstring), or None at the minimum or for an unsupported form.

    >>> soften_expression("42 * 25"), soften_expression("42 * 5"), soften_expression("2 * 5")
    ('42 * 5', '2 * 5', None)
    >>> soften_expression("20 + 37"), soften_expression("205 - 1"), soften_expression("3 + 4 + 5")
    ('20 + 7', '20 - 1', '3 + 4')
    >>> soften_expression("12 * 21"), soften_expression("12 + 21")
    ('12 * 2', '12 + 1')
    """
    if not _PLAIN.fullmatch(expression):
        return None
    spans = list(_NUMBER.finditer(expression))
    if len(spans) < 2:
        return None
    widest = max(len(m.group()) for m in spans)
    if widest >= 2:
        m = [m for m in spans if len(m.group()) == widest][-1]
        digits = m.group()
        shorter = str(int(digits[1:]))
        if int(shorter) == 0 or (int(shorter) == 1 and "*" in expression) or len(shorter) < len(digits) - 1:
            shorter = digits[:-1]
            if int(shorter) == 1 and "*" in expression:
                return None  # 10 * 7 would become 1 * 7, which poses its answer
        return expression[:m.start()] + shorter + expression[m.end():]
    if len(spans) > 2:
        return expression[:spans[-2].end()]
    return None


def step_down(row: dict) -> tuple[str, str] | str:
    """(`row`'s expression, the one a step easier), or why it has none (an `unsupported` reason): `row` must be
    an rg: task of SOFTENED whose expression is once in its text, above the minimum."""
    task = row["source"][3:] if row["source"].startswith("rg:") else None
    if task not in SOFTENED:
        return f"unsupported: soften needs an rg: source of {', '.join(SOFTENED)}"
    expression = json.loads(row.get("meta") or "{}").get("expression")
    if not isinstance(expression, str) or row["text"].count(expression) != 1:
        return "unsupported: soften needs the item's expression, once in its text"
    easier = soften_expression(expression)
    if easier is None:
        return f"unsupported: at the minimum ({expression!r} has no easier step)"
    return expression, easier


def can_soften(row: dict) -> bool:
    """Has `row` a step down (`step_down`)?"""
    return not isinstance(step_down(row), str)


def softened_row(parent: dict, root: dict, run_id: str, round: int,
                 lengths: Lengths = LENGTHS) -> tuple[dict | None, str | None]:
    """The one-step-easier sibling of `parent` (an original, or a rung of `root`'s lineage), made its child.
    (child, rejection reason)."""
    step = step_down(parent)
    if isinstance(step, str):
        return None, step
    expression, easier = step
    meta = json.loads(parent.get("meta") or "{}")
    try:
        answer = str(value_of(easier))
    except NoSolution as e:
        return None, f"unsupported: {easier!r} has no exact value ({e})"
    widths = [len(n) for n in _NUMBER.findall(easier)]
    text = parent["text"].replace(expression, easier)
    child = child_row(parent, text, "soften", run_id, round, answer=answer, meta_extra={
        "expression": easier, "num_terms": len(widths), "num_digits": max(widths),
        "level": "digits " + ",".join(map(str, widths)), "soften_depth": int(meta.get("soften_depth", 0)) + 1})
    child["solution"] = worked_solution(parent["source"][3:], text, answer, child["meta"])
    return child, check_child(text, parent["text"], answer, min_chars=lengths.min_chars, max_chars=lengths.max_chars)


def rung_above(parent: dict, root: dict, run_id: str, round: int) -> dict | None:
    """The rung one step above `parent` in its lineage: the root at depth 1, else the rung rebuilt from the root
    by depth - 1 steps (its prompt id is the stored one's: the steps are deterministic)."""
    depth = int(json.loads(parent.get("meta") or "{}").get("soften_depth", 1))
    row = root
    for _ in range(depth - 1):
        row, _ = softened_row(row, root, run_id, round)
        if row is None:
            return None
    return row


@register
class Soften(Strategy):
    name = "soften"
    buckets = frozenset({"too_hard"})

    def slot(self, parent: Parent, view: RoundView) -> str | None:
        if parent.transform == self.name:
            if view.solved(parent):
                return PROMOTE
            return self.name if parent.bucket in self.buckets and can_soften(parent.row) else None
        return super().slot(parent, view) if can_soften(parent.row) else None

    def propose(self, parent: Parent, view: RoundView) -> list[Proposal]:
        if parent.transform == self.name and view.solved(parent):
            above = rung_above(parent.row, parent.root, view.run_id, view.round)
            reason = None if above is not None else "unsupported: the rung above could not be rebuilt"
            return [Proposal(parent.row, above, reason, gate="judged")]
        return [Proposal(parent.row, *softened_row(parent.row, parent.root, view.run_id, view.round, view.lengths),
                         gate="judged")]
