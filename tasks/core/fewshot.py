"""How a question becomes chat turns: the one rendering of a question (`ask`) and fewshot_context (CBRL,
arXiv 2603.18953; docs/algorithms.md §3), a rollout-time augmentation.

`ask(question, instruction)` is the user turn every stage sends: the question, a newline, the configured
instruction, stripped. Collect, evaluate, rescore, shaping and the SFT traces of training all use it, so the
policy sees one prompt format everywhere.

In round t of T, each prompt gets, with probability p_t = p0 * (1 - t / T), k solved demonstrations as
earlier chat turns: correct stored rollouts of *sibling* prompts from this run's earlier rounds. A sibling has
the same source and another lineage (`root_id`): a prompt's own variants (its ladder rungs, hint prefixes,
scaffold rewrites, and the original behind them) share its answer, so a solved one shown as an earlier turn
would hand the policy the answer (the mcq10 rung of "What is 7*8?" was shown its solved mcq4 rung, ending in
\\boxed{56}). Both the prompts and the demonstrations must therefore carry `root_id`; without it no
demonstration can be chosen and the call fails with a one-line error, rather than risk the leak. The choice is
seeded per (run, round, prompt), and the demonstrations used are recorded on every rollout row
(`augmentation`), so the effect can be queried later. tasks/sampling/demonstrations.py reads the
demonstrations from the store.

Under a token budget, p_t = p0 * (1 - spent / budget) instead (issue 50): a run that its budget
stops after 3 of 12 rounds would otherwise still show demonstrations at 0.75 p0 in its last round. `spent` is
the run's generated tokens before the round, evaluation excluded (the figure the flow checks the budget
against), so p_t is fixed within a round.
"""

from __future__ import annotations

import json
import random

import polars as pl

from tasks.core.ids import seed_of


def ask(question: str, instruction: str) -> dict:
    """The user turn of `question` with the configured instruction.

    >>> turn = ask("What is 2 + 2?", "Answer briefly.")
    >>> turn["role"], turn["content"].splitlines()
    ('user', ['What is 2 + 2?', 'Answer briefly.'])
    """
    return {"role": "user", "content": f"{question}\n{instruction}".strip()}


def fewshot_probability(round: int, rounds: int, p0: float, spent: int | None = None,
                        budget: int | None = None) -> float:
    """p_t = p0 * (1 - t/T); with a token budget, p_t = p0 * (1 - spent/budget) (0 once it is spent).

    >>> fewshot_probability(0, 4, 0.5), fewshot_probability(2, 4, 0.5), fewshot_probability(4, 4, 0.5)
    (0.5, 0.25, 0.0)
    >>> fewshot_probability(1, 12, 0.5, spent=30_000, budget=60_000), fewshot_probability(1, 12, 0.5, 70_000, 60_000)
    (0.25, 0.0)
    """
    if budget is not None:
        if budget <= 0 or spent is None or spent < 0:
            raise ValueError(f"few-shot annealing over a token budget needs budget > 0 and spent >= 0, "
                             f"got budget {budget}, spent {spent}")
        return max(0.0, p0 * (1 - spent / budget))
    return max(0.0, p0 * (1 - round / rounds))


def fewshot_messages(prompts: pl.DataFrame, demos: pl.DataFrame, seed: int, round: int, rounds: int,
                     p0: float, k: int, instruction: str, spent: int | None = None,
                     budget: int | None = None) -> tuple[list[list[dict]], list[str | None]]:
    """Chat messages per prompt and the augmentation record (None when no demonstration was added).
    `prompts` (prompt_id, text, source, root_id) and `demos` (from `demonstrations`) need `root_id` whenever a
    demonstration could be added: a demonstration never shares the prompt's lineage. The draws (whether a
    prompt gets demonstrations, and which) are keyed by (seed, round, prompt), not by run: two arms of a
    comparison at one seed draw alike wherever their demonstration pools agree (paired seeds). With `budget`
    (the run's token budget) and `spent` (its generated tokens before this round), p anneals over the budget
    (`fewshot_probability`)."""
    p = fewshot_probability(round, rounds, p0, spent, budget)
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
        turn = ask(row["text"], instruction)
        rng = random.Random(seed_of(f"{seed}\x1f{round}\x1f{row['prompt_id']}"))
        drawn = k > 0 and rng.random() < p
        siblings = [d for d in by_source.get(row["source"], []) if d["root_id"] != row["root_id"]] if drawn else []
        if not siblings:
            messages.append([turn])
            records.append(None)
            continue
        chosen = rng.sample(siblings, min(k, len(siblings)))
        turns = []
        for d in chosen:
            turns += [ask(d["question"], instruction), {"role": "assistant", "content": d["completion"]}]
        messages.append([*turns, turn])
        records.append(json.dumps({"fewshot_context": [d["prompt_id"] for d in chosen], "p": p}))
    return messages, records
