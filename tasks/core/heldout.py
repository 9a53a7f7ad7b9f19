"""Held-out evaluation's pure parts: the held-out split and the pass@k estimator (docs/algorithms.md §2, §7.2).

The held-out set is fixed when the run starts (round 0's pool); `eval.heldout_split` picks the rule:

- "flat" (`heldout_roots`, the rule of runs made before the choice existed): round(fraction x n) of the root
  prompts, ranked by a hash of (eval seed, root_id). Strata are held out only by chance, and a held-out
  "6 + 9" can have its twin "9 + 6" in training.
- "stratified" (`stratified_heldout`, the default): prompts are first grouped into twin groups by `twin_key`,
  and a group is held out or trained whole. Each stratum (one pool source entry: source + params, named by
  `stratum_name`) holds out round(fraction x the twin groups it touches) groups, at least one where it touches
  two or more and never all of them. Groups are ranked once by a hash of (eval seed, twin key); strata are
  filled in the order given (the config's): each takes its top-ranked groups until its quota is met, counting
  groups an earlier stratum already took. A group spanning two strata (the same fact under two templates) can
  so give the later stratum more than its quota; one ranking for all strata keeps that rare.

The twin key (`twin_key`): the sorted multiset of the unsigned numbers in the question plus the answer, without
the source, so "6 + 9" / "9 + 6" share one ("15" from {6, 9}), and so do "Calculate 6 + 9." and "State the
final answer to the following arithmetic problem: 9 + 6 =" (the same fact under two sources' templates, which
the evidence pool's one-digit sources repeat); "9 - 6" / "6 - 9" do not (answers 3 and -3). A question without
numbers is its own group (keyed by its text). Known false merges, all harmless (they only move prompts
together): an operation that gives the same answer on the same numbers (n + 0 / n - 0, 2 + 2 / 2 * 2, 4 - 2 /
4 / 2), and the negated-operand forms of one sum (-5 - 3 / -3 - 5, a true twin). A number fixed by a template
("to 2 decimal places") is part of every key of that template, so it merges nothing by itself.

pass@k is the unbiased estimator 1 - C(n - c, k) / C(n, k) (Chen et al. 2021).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from math import comb
from typing import Any

_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct.

    >>> pass_at_k(4, 0, 2), pass_at_k(4, 4, 2), round(pass_at_k(4, 1, 2), 4)
    (0.0, 1.0, 0.5)
    """
    if k > n:
        raise ValueError(f"pass@{k} needs at least k samples, got n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def _rank(seed: int, key: str) -> str:
    return hashlib.sha256(f"{seed}\x1f{key}".encode()).hexdigest()


def heldout_roots(root_ids: list[str], fraction: float, seed: int) -> set[str]:
    """The "flat" split: round(fraction * n) roots (at least one, and never all when n > 1), chosen by a
    seeded hash."""
    roots = sorted(set(root_ids))
    if not roots or fraction <= 0:
        return set()
    n = min(max(1, round(fraction * len(roots))), max(1, len(roots) - 1))
    ranked = sorted(roots, key=lambda r: _rank(seed, r))
    return set(ranked[:n])


def twin_key(text: str, answer: str) -> str:
    """The key twins share: the question's unsigned numbers, sorted, and the answer (module docstring).

    >>> twin_key("Calculate 6 + 9.", "15") == twin_key("State the final answer: 9 + 6 =", "15")
    True
    >>> twin_key("Calculate 9 - 6.", "3") == twin_key("Calculate 6 - 9.", "-3")
    False
    >>> twin_key("Spell the word.", "x") == twin_key("Spell the  word.", "y")
    False
    """
    numbers = sorted(_NUMBER.findall(text), key=lambda s: (float(s), s))
    if not numbers:
        return "text\x1f" + " ".join(text.split()) + "\x1f" + answer.strip()
    return "nums\x1f" + ",".join(numbers) + "\x1f" + answer.strip()


def stratum_name(source: str, params: dict[str, Any]) -> str:
    """One pool source entry's stratum: its source and difficulty params, e.g. "rg:products{max_digits=1}".

    >>> stratum_name("rg:chain_sum", {"max_terms": 2, "max_digits": 1}), stratum_name("data/x.jsonl", {})
    ('rg:chain_sum{max_digits=1,max_terms=2}', 'data/x.jsonl')
    """
    if not params:
        return source
    inner = ",".join(f"{k}={json.dumps(v, separators=(',', ':'), default=str)}" for k, v in sorted(params.items()))
    return source + "{" + inner + "}"


def stratified_heldout(prompts: Iterable[tuple[str, str, str]], fraction: float, seed: int) -> set[str]:
    """The "stratified" split of (prompt_id, stratum, twin key) rows, strata in the order they first appear:
    the held-out prompt ids (module docstring)."""
    rows = list(prompts)
    if not rows or fraction <= 0:
        return set()
    members: dict[str, set[str]] = {}  # twin key -> prompt ids
    touches: dict[str, list[str]] = {}  # stratum -> its twin keys, best-ranked first
    for pid, stratum, key in rows:
        members.setdefault(key, set()).add(pid)
        touches.setdefault(stratum, [])
        if key not in touches[stratum]:
            touches[stratum].append(key)
    ranked = sorted(members, key=lambda k: (_rank(seed, k), k))
    order = {k: i for i, k in enumerate(ranked)}
    held: set[str] = set()
    for keys in touches.values():
        keys.sort(key=order.__getitem__)
        n = len(keys)
        quota = min(max(1, round(fraction * n)), n - 1) if n >= 2 else 0
        have = sum(k in held for k in keys)
        for k in keys:
            if have >= quota:
                break
            if k not in held:
                held.add(k)
                have += 1
    if not held and len(ranked) >= 2:  # every stratum had one group: still hold one out, as "flat" does
        held.add(ranked[0])
    if len(held) == len(ranked) and len(ranked) >= 2:  # never all
        held.discard(max(held, key=order.__getitem__))
    return {pid for k in held for pid in members[k]}
