"""fewshot_context (CBRL, arXiv 2603.18953; ALGORITHMS.md §3): a rollout-time augmentation.

In round t of T, each prompt gets, with probability p_t = p0 * (1 - t / T), k solved demonstrations as
earlier chat turns: correct stored rollouts of *sibling* prompts (same source, another prompt) from this
run's earlier rounds. The choice is seeded per (run, round, prompt), and the demonstrations used are
recorded on every rollout row (`augmentation`), so the effect can be queried later.
"""

from __future__ import annotations

import hashlib
import json
import random

import polars as pl

from storage.query import scan
from storage.store import Store


def fewshot_probability(round: int, rounds: int, p0: float) -> float:
    """p_t = p0 * (1 - t/T).

    >>> fewshot_probability(0, 4, 0.5), fewshot_probability(2, 4, 0.5), fewshot_probability(4, 4, 0.5)
    (0.5, 0.25, 0.0)
    """
    return max(0.0, p0 * (1 - round / rounds))


def demonstrations(store: Store, run_id: str, round: int) -> pl.DataFrame:
    """One correct rollout per solved prompt of this run's earlier rounds: prompt_id, source, question, completion."""
    solved = (scan(store, "rollouts")
              .filter((pl.col("run_id") == run_id) & (pl.col("round") < round) & pl.col("correct")
                      & pl.col("augmentation").is_null())
              .group_by("prompt_id").agg(pl.col("completion").sort_by(pl.col("n_tokens")).first()))
    prompts = scan(store, "prompts").select("prompt_id", "source", pl.col("text").alias("question")).unique("prompt_id")
    return solved.join(prompts, on="prompt_id").sort("prompt_id").collect()


def fewshot_messages(prompts: pl.DataFrame, demos: pl.DataFrame, run_id: str, round: int, rounds: int,
                     p0: float, k: int, instruction: str) -> tuple[list[list[dict]], list[str | None]]:
    """Chat messages per prompt and the augmentation record (None when no demonstration was added)."""
    p = fewshot_probability(round, rounds, p0)
    by_source: dict[str, list[dict]] = {}
    for d in demos.iter_rows(named=True):
        by_source.setdefault(d["source"], []).append(d)
    messages, records = [], []
    for row in prompts.iter_rows(named=True):
        ask = {"role": "user", "content": f"{row['text']}\n{instruction}".strip()}
        seed = int(hashlib.sha256(f"{run_id}\x1f{round}\x1f{row['prompt_id']}".encode()).hexdigest()[:8], 16)
        rng = random.Random(seed)
        siblings = [d for d in by_source.get(row["source"], []) if d["prompt_id"] != row["prompt_id"]]
        if k == 0 or rng.random() >= p or not siblings:
            messages.append([ask])
            records.append(None)
            continue
        chosen = rng.sample(siblings, min(k, len(siblings)))
        turns = []
        for d in chosen:
            turns += [{"role": "user", "content": f"{d['question']}\n{instruction}".strip()},
                      {"role": "assistant", "content": d["completion"]}]
        messages.append([*turns, ask])
        records.append(json.dumps({"fewshot_context": [d["prompt_id"] for d in chosen], "p": p}))
    return messages, records
