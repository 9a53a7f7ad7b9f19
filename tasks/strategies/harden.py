"""harden (docs/algorithms.md §3.5): a saturated reasoning-gym original gets a sibling problem one difficulty step
up: the generator's `max_digits` (or, failing that, `max_terms`) plus one, seeded by the parent's id.

It is a new problem with a new answer, so the gate's checks, which compare a child with its parent's answer, do
not apply (`gate = "judged"`). A source without such a setting (a file, a task without those fields) makes no
child (`unsupported`), and the prompt moves to reserve like any non-informative original.
"""

from __future__ import annotations

import json

from tasks.core.ids import seed_of
from tasks.strategies.base import Parent, Proposal, RoundView, Strategy, child_row, register

SEED_HEX = 7  # hex digits of the parent id's digest that seed the harder problem (as first written)


def harden_child(parent: dict, run_id: str, round: int) -> tuple[dict | None, str | None]:
    """A sibling problem one reasoning-gym difficulty step up (a new problem, so a new answer)."""
    if not parent["source"].startswith("rg:"):
        return None, "unsupported: harden needs an rg: source"
    from tasks.core.sources import rg_config_fields, rg_rows

    task_name = parent["source"][3:]
    params = json.loads(parent["params"] or "{}")
    fields = rg_config_fields(task_name)
    key = next((k for k in ("max_digits", "max_terms") if k in fields), None)
    if key is None:
        return None, f"unsupported: harden needs max_digits/max_terms, which rg:{task_name} lacks"
    gen = {k: v for k, v in params.items() if k in fields}
    gen[key] = int(gen.get(key, fields[key])) + 1
    row = rg_rows(task_name, 1, seed_of(parent["prompt_id"], SEED_HEX), gen)[0]
    return child_row(parent, row.text, "harden", run_id, round, json.loads(row.meta), answer=row.answer,
                     params=row.params), None


@register
class Harden(Strategy):
    name = "harden"
    buckets = frozenset({"saturated"})

    def propose(self, parent: Parent, view: RoundView) -> list[Proposal]:
        return [Proposal(parent.row, *harden_child(parent.row, view.run_id, view.round), gate="judged")]
