"""Generate the evidence comparison's external sets (issue 49, item 6) from reasoning-gym (open-thought, PyPI
`reasoning-gym`), generators no one in this project wrote. Both are frozen in the repository, made once by this
command, offline and deterministic, and never used for tuning (no config was chosen by its score on them):

    python data/external/make_external.py            # writes both files
    python data/external/make_external.py --check    # exits 1 when a file differs from what this script makes

- data/external/reasoning_gym_ood.jsonl: 300 questions, 60 per task, seeded (20261201 + the task's number below;
  2 was leg_counting's, dropped at the floor). `near`: tasks the pool draws from at levels it never uses (three
  terms; multiplication among basic_arithmetic's operators); `far`: tasks it never uses (gcd, lcm,
  letter_counting) at easy levels. Each task's first 25 rows are the 125-row set the first comparison used
  (data/external/make_reasoning_gym_ood.py, since replaced by this script), duplicates included; the other 35
  are the generator's next questions not already in the set. Those 125 were checked against the base model once,
  before any comparison ran (4 samples, temperature 0.7): pass@1 0.10 overall; leg_counting scored 0.01.
- data/external/in_family_harder.jsonl: 300 questions one step past the evidence pool (benchmarks/evidence.toml),
  where a curriculum that climbs should show first: 150 products of a two-digit and a one-digit (2..9) number
  (the pool has one-by-one and two-by-two digits; reasoning-gym's products draws one digit count per question,
  so `two_by_one` draws them itself, seeded, in that generator's question template) and 150 three-term one-digit
  chain sums from reasoning-gym's chain_sum (the pool has two terms), seeded 20261301 and 20261302, distinct
  questions.
Every answer is one integer, so the project's math verifier judges them as it judges the pool. Each row is the
ingest schema (question, answer, id, meta): `id` is `<task>/<index in the generator>`, `meta` holds the task,
the kind and the generator's parameters, so results split by task and kind (`eval_results` joined to
`prompts`).
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run as a script: the folder of the script is not a package to import from

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "data" / "external"

OOD_SEED, OOD_FIRST, OOD_PER_TASK = 20261201, 25, 60
OOD_TASKS = [
    (0, "basic_arithmetic", "near", {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1,
                                  "operators": ["+", "-", "*"], "allow_parentheses": False,
                                  "allow_negation": False}),
    (1, "products", "near", {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1}),
    (3, "gcd", "far", {"min_numbers": 2, "max_numbers": 2, "min_value": 2, "max_value": 30}),
    (4, "lcm", "far", {"min_numbers": 2, "max_numbers": 2, "min_value": 2, "max_value": 12}),
    (5, "letter_counting", "far", {"min_words": 3, "max_words": 6}),
]
PRODUCTS_TEMPLATE = "Solve the following multiplication: {} * {}. Give only the result as your final answer."


def two_by_one(size: int, seed: int) -> list[dict]:
    """Products of a two-digit and a one-digit factor (2..9) in random order, in reasoning-gym products'
    question template: its generator draws one digit count per question, so it cannot make them."""
    rng = random.Random(seed)
    items = []
    for _ in range(size):
        a, b = rng.randint(10, 99), rng.randint(2, 9)
        a, b = (a, b) if rng.random() < 0.5 else (b, a)
        items.append({"question": PRODUCTS_TEMPLATE.format(a, b), "answer": a * b})
    return items


def chain_sums(size: int, seed: int) -> list[dict]:
    import reasoning_gym as rg

    return list(rg.create_dataset("chain_sum", size=size, seed=seed, **HARDER[1][3]))


HARDER = [  # (seed, task, kind, params, make, count)
    (20261301, "products", "two_by_one", {"factors": "10..99 and 2..9"}, two_by_one, 150),
    (20261302, "chain_sum", "three_terms", {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1},
     chain_sums, 150),
]


def _row(task: str, j: int, item: dict, kind: str, params: dict) -> dict:
    answer = str(item["answer"]).strip()
    int(answer)  # every answer is one integer (raises otherwise: the set would need another verifier)
    return {"id": f"{task}/{j}", "question": item["question"], "answer": answer,
            "meta": {"task": task, "kind": kind, "params": params}}


def ood() -> list[dict]:
    import reasoning_gym as rg

    rows = []
    for i, task, kind, params in OOD_TASKS:
        items = list(rg.create_dataset(task, size=OOD_PER_TASK * 20, seed=OOD_SEED + i, **params))
        mine = [_row(task, j, items[j], kind, params) for j in range(OOD_FIRST)]
        seen = {r["question"] for r in mine}
        for j in range(OOD_FIRST, len(items)):
            if len(mine) == OOD_PER_TASK:
                break
            if items[j]["question"] not in seen:
                seen.add(items[j]["question"])
                mine.append(_row(task, j, items[j], kind, params))
        if len(mine) < OOD_PER_TASK:
            raise SystemExit(f"{task}: only {len(mine)} distinct questions")
        rows += mine
    return rows


def in_family_harder() -> list[dict]:
    rows = []
    for seed, task, kind, params, make, count in HARDER:
        mine, seen = [], set()
        for j, item in enumerate(make(count * 20, seed)):
            if len(mine) == count:
                break
            if item["question"] not in seen:
                seen.add(item["question"])
                mine.append(_row(task, j, item, kind, params))
        if len(mine) < count:
            raise SystemExit(f"{task} {kind}: only {len(mine)} distinct questions")
        rows += mine
    return rows


SETS = {"reasoning_gym_ood.jsonl": ood, "in_family_harder.jsonl": in_family_harder}


def text(rows: list[dict]) -> str:
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the files instead of writing them")
    args = ap.parse_args(argv)
    stale = []
    for name, make in SETS.items():
        want, path = text(make()), OUT / name
        if args.check:
            if not path.exists() or path.read_text() != want:
                stale.append(str(path.relative_to(REPO)))
        else:
            path.write_text(want)
            print(f"{path.relative_to(REPO)}: {want.count(chr(10))} rows")
    if stale:
        print(f"make_external.py: error: {', '.join(stale)} differ from what this script makes", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
