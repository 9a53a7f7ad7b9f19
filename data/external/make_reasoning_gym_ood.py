"""Generate the external held-out set `reasoning_gym_ood.jsonl` from reasoning-gym (open-thought, PyPI
`reasoning-gym`), generators no one in this project wrote. It is frozen in the repository; runs never call
this script. It runs offline in the project's own environment:

    python data/external/make_reasoning_gym_ood.py > data/external/reasoning_gym_ood.jsonl

Two kinds of question, 25 each per task, seeded (seed 20261201 + the task's number below; 2 was leg_counting's), in task order:
- `near`: tasks the default training pool draws from (basic_arithmetic, products), at difficulty levels it
  never uses (three terms instead of two; multiplication among the operators of basic_arithmetic);
- `far`: tasks the pool never uses (gcd, lcm, letter_counting), at easy levels, since the 135M policy solves
  few of the hard ones (DeepMind's mathematics_dataset, the other external set, sits at pass@1 0.03 for it).
Checked against the base model once, before any comparison ran (`refinery eval --dataset`, 4 samples per
prompt, temperature 0.7): pass@1 basic_arithmetic 0.13, products 0.12, gcd 0.16, lcm 0.155 (21 distinct
prompts of 25), letter_counting 0.06; leg_counting (1-2 animals, 1-4 of each) scored 0.01, at the floor, so it
was dropped before freezing.
Every answer is one integer, so the project's math verifier judges it as it judges the pool. Each row is the
ingest schema (question, answer, id, meta): `id` is `<task>/<index>`, `meta` holds the task, the kind and the
generator's parameters, so results can be split by task and kind (`eval_results` joined to `prompts`).
"""

import json
import sys

import reasoning_gym as rg

SEED = 20261201
PER_TASK = 25
TASKS = [
    (0, "basic_arithmetic", "near", {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1,
                                  "operators": ["+", "-", "*"], "allow_parentheses": False,
                                  "allow_negation": False}),
    (1, "products", "near", {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1}),
    (3, "gcd", "far", {"min_numbers": 2, "max_numbers": 2, "min_value": 2, "max_value": 30}),
    (4, "lcm", "far", {"min_numbers": 2, "max_numbers": 2, "min_value": 2, "max_value": 12}),
    (5, "letter_counting", "far", {"min_words": 3, "max_words": 6}),
]


def main() -> None:
    for i, task, kind, params in TASKS:
        for j, item in enumerate(rg.create_dataset(task, size=PER_TASK, seed=SEED + i, **params)):
            answer = str(item["answer"]).strip()
            int(answer)  # every answer is one integer (raises otherwise: the set would need another verifier)
            row = {"id": f"{task}/{j}", "question": item["question"], "answer": answer,
                   "meta": {"task": task, "kind": kind, "params": params}}
            sys.stdout.write(json.dumps(row, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
