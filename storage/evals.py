"""Evaluations another run of the store already made that this run can reuse instead of generating them again.

The base model's greedy evaluation on a held-out set (milestone 0 of every run) is the same computation in
every run that shares the base model, the backend and dtype, the held-out prompts, the instruction, the
longest completion and the verifier: greedy decoding draws nothing, so the rows it lands are the same. Paired
arms of a comparison share it by construction (the same pool and split at every seed), and it is the costliest
evaluation a run makes: the base model writes the longest completions (23 tokens per held-out sample in the
committed comparison store, against 11-19 after training). `tasks/evaluate.py` names that computation by a digest (its
`plan_key`, stored in `evals.plan_key`); a run whose key matches an evaluation another run landed copies that
run's per-prompt rows and records `evals.reused_from`. What it copies was generated once, by the other run,
and counted there: the reusing run's `generated_tokens` gains nothing, so a comparison's cost counts it once.

Choices: only greedy evaluations carry a key (a sampled one is seeded per run; reusing it would pair arms on
identical evaluation noise, which the seeds exist to vary); the oldest landed evaluation with the key is the
source, so every reuser copies the same rows; a batch kernel's last-bit nondeterminism between processes is
the one difference reuse removes, and it favours no arm.
"""

from __future__ import annotations

import polars as pl

from storage.query import scan
from storage.store import Store


def reusable_evaluation(store: Store, plan_key: str, run_id: str) -> tuple[str, pl.DataFrame] | None:
    """(source run, its eval_results rows: prompt_id, n_samples, n_correct, n_tokens) of the evaluation with
    `plan_key` another run landed first; None when there is none."""
    landed = (scan(store, "evals").filter((pl.col("plan_key") == plan_key) & (pl.col("run_id") != run_id)
                                          & pl.col("reused_from").is_null())
              .select("run_id", "round", "policy_version", "split").collect())
    if landed.height == 0:
        return None
    first = landed.sort("run_id", "round").row(0, named=True)
    keys = ("run_id", "round", "policy_version", "split")
    rows = (scan(store, "eval_results").filter(pl.all_horizontal([pl.col(k) == first[k] for k in keys]))
            .select("prompt_id", "n_samples", "n_correct", "n_tokens").sort("prompt_id").collect())
    return (first["run_id"], rows) if rows.height else None
