"""Generate the external held-out set `mathematics_dataset_easy.jsonl` from DeepMind's mathematics_dataset
(Saxton et al. 2019, arXiv 1904.01557; PyPI `mathematics_dataset` 1.0.1), a generator no one in this project
wrote. It is frozen in the repository; runs never call this script.

The package needs sympy 1.5.1 (newer sympy removed `base_solution_linear`), so it runs in its own virtual
environment, never in the project's:

    python3 -m venv /tmp/mdvenv
    /tmp/mdvenv/bin/pip install mathematics_dataset==1.0.1 sympy==1.5.1
    /tmp/mdvenv/bin/python data/external/make_mathematics_dataset.py > data/external/mathematics_dataset_easy.jsonl

Choices: the `train-easy` difficulty (the lowest third of each module's entropy range: a 135M policy solves
few of the harder ones); modules whose answer is one number, so the project's math verifier can judge it; 25
questions per module, seeded (Python's and numpy's generators, seed 20261201; PYTHONHASHSEED 0, which the
script sets for itself, since sympy iterates sets in hash order), in module order. Each row is
the ingest schema (question, answer, id, meta): `id` is `<module>/<index>`, `meta.module` the module, so
results can be split by module. `arithmetic__*` modules are close to the training pool's small-digit
arithmetic (in-distribution by kind, larger numbers); the others are out of distribution for it.
"""

import json
import os
import random
import sys

if os.environ.get("PYTHONHASHSEED") != "0":  # sympy's set iteration follows string hashes: fix them, or
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"})  # reruns differ

import numpy as np
from absl import flags
from mathematics_dataset import generate

MODULES = [
    "arithmetic__add_or_sub", "arithmetic__add_sub_multiple", "arithmetic__mul", "arithmetic__div",
    "arithmetic__mixed", "numbers__gcd", "numbers__lcm", "numbers__div_remainder", "numbers__round_number",
    "algebra__linear_1d",
]
PER_MODULE = 25
SEED = 20261201


def main() -> None:
    flags.FLAGS(["make_mathematics_dataset"])  # generate's sampler reads its absl flags (show_dropped)
    random.seed(SEED)
    np.random.seed(SEED)
    generate.init_modules(train_split=True)
    easy = generate.filtered_modules["train-easy"]
    for name in MODULES:
        module = easy[name]
        for i in range(PER_MODULE):
            problem, _ = generate.sample_from_module(module)
            row = {"id": f"{name}/{i}", "question": str(problem.question), "answer": str(problem.answer),
                   "meta": {"module": name, "generator": "mathematics_dataset 1.0.1", "difficulty": "train-easy",
                            "seed": SEED}}
            sys.stdout.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
