"""fewshot_context (CBRL, arXiv 2603.18953; docs/algorithms.md §3): a rollout-time augmentation.

In round t of T, each prompt gets, with probability p_t = p0 * (1 - t / T), k solved demonstrations as
earlier chat turns: correct stored rollouts of *sibling* prompts from this run's earlier rounds. A sibling has
the same source and another lineage (`root_id`): a prompt's own variants (its ladder rungs, hint prefixes,
scaffold rewrites, and the original behind them) share its answer, so a solved one shown as an earlier turn
would hand the policy the answer (the mcq10 rung of "What is 7*8?" was shown its solved mcq4 rung, ending in
\\boxed{56}). Both the prompts and the demonstrations must therefore carry `root_id`; without it no
demonstration can be chosen and the call fails with a one-line error, rather than risk the leak. The choice is seeded per
(run, round, prompt), and the demonstrations used are recorded on every rollout row (`augmentation`), so the
effect can be queried later.
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
    """One correct rollout per solved prompt of this run's earlier rounds: prompt_id, source, root_id, question,
    completion."""
    solved = (scan(store, "rollouts")
              .filter((pl.col("run_id") == run_id) & (pl.col("round") < round) & pl.col("correct")
                      & pl.col("augmentation").is_null())
              .group_by("prompt_id").agg(pl.col("completion").sort_by(pl.col("n_tokens")).first()))
    prompts = (scan(store, "prompts").select("prompt_id", "source", "root_id", pl.col("text").alias("question"))
               .unique("prompt_id"))
    return solved.join(prompts, on="prompt_id").sort("prompt_id").collect()


def fewshot_messages(prompts: pl.DataFrame, demos: pl.DataFrame, run_id: str, round: int, rounds: int,
                     p0: float, k: int, instruction: str) -> tuple[list[list[dict]], list[str | None]]:
    """Chat messages per prompt and the augmentation record (None when no demonstration was added).
    `prompts` (prompt_id, text, source, root_id) and `demos` (from `demonstrations`) need `root_id` whenever a
    demonstration could be added: a demonstration never shares the prompt's lineage."""
    p = fewshot_probability(round, rounds, p0)
    if k > 0 and p > 0 and demos.height:
        for name, frame in (("prompts", prompts), ("demonstrations", demos)):
            if "root_id" not in frame.columns:
                raise ValueError(f"few-shot context needs the {name}' root_id, to keep a prompt's own lineage "
                                 "(its rungs and rewrites, which share its answer) out of its demonstrations")
    by_source: dict[str, list[dict]] = {}
    for d in demos.iter_rows(named=True):
        by_source.setdefault(d["source"], []).append(d)
    messages, records = [], []
    for row in prompts.iter_rows(named=True):
        ask = {"role": "user", "content": f"{row['text']}\n{instruction}".strip()}
        seed = int(hashlib.sha256(f"{run_id}\x1f{round}\x1f{row['prompt_id']}".encode()).hexdigest()[:8], 16)
        rng = random.Random(seed)
        drawn = k > 0 and rng.random() < p
        siblings = [d for d in by_source.get(row["source"], []) if d["root_id"] != row["root_id"]] if drawn else []
        if not siblings:
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
