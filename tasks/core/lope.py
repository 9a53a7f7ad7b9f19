"""lorem_perturb (LoPE, arXiv 2605.05566; docs/algorithms.md §3): a rollout-time rescue of all-fail groups.

A group whose G rollouts all failed carries no GRPO signal. LoPE resamples it under G' = P * S perturbed
contexts (P Lorem-Ipsum system prefixes of 100-300 words, S samples each). Correct resamples replace up to
G - 1 of the group's failures, so at least one failure always stays and the group has a non-zero variance.

A replaced rollout was sampled under the perturbed prompt, so it is off-policy for the plain prompt. It keeps
the plain prompt's `prompt_text` (what the trainer conditions on) and records in `augmentation` the prefix it
was sampled under, the rendered perturbed prompt (`behaviour_prompt`) and its behaviour log-prob; the
trainer takes old log-probs under the behaviour prompt and shapes the importance ratio as rho / (rho + 0.1)
(`is_lope_replaced`, `shaped_ratio`). Kept rollouts of a rescued group record the attempt, so SQL can count
attempts, rescues and replacements per round.

The rescue feeds training only: a replacement also records the reward of the policy's own sample it displaced
(`own_reward`), and EPS, buckets, promotion, shaping and the pool read those own samples, so a rescued group
stays too_hard.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from models.backend import Backend, Completion, Sampling
from models.lorem import LOREM
from models.meter import record
from tasks.core.seeds import row_seeds

RATIO_FLOOR = 0.1  # rho / (rho + 0.1)


def lorem_prefixes(n: int, seed: int, min_words: int = 100, max_words: int = 300) -> list[str]:
    """n distinct Lorem-Ipsum passages, lengths spread evenly over [min_words, max_words], seeded.

    >>> [len(p.split()) for p in lorem_prefixes(6, 0)]
    [100, 140, 180, 220, 260, 300]
    """
    rng = random.Random(seed)
    lengths = [min_words + round(i * (max_words - min_words) / max(n - 1, 1)) for i in range(n)]
    out = []
    for length in lengths:
        words, sentence = [], 0
        for _ in range(length):
            w = rng.choice(LOREM)
            words.append(w.capitalize() if sentence == 0 else w)
            sentence += 1
            if sentence >= rng.randint(6, 14):
                words[-1] += "."
                sentence = 0
        if not words[-1].endswith("."):
            words[-1] += "."
        out.append(" ".join(words))
    return out


def shaped_ratio(rho: Any) -> Any:
    """The importance ratio of a LoPE-replaced rollout in the policy loss: rho / (rho + 0.1).
    Works on floats and tensors.

    >>> round(shaped_ratio(1.0), 4), round(shaped_ratio(0.1), 4)
    (0.9091, 0.5)
    """
    return rho / (rho + RATIO_FLOOR)


def is_lope_replaced(augmentation: str | None) -> bool:
    """Whether a rollout row is a LoPE replacement (its ratio gets shaped)."""
    if not augmentation:
        return False
    return bool(json.loads(augmentation).get("lorem_perturb", {}).get("replaced"))


@dataclass
class Rescue:
    groups: int = 0  # all-fail groups resampled
    rescued: int = 0  # of which at least one resample was correct
    replaced: int = 0  # rollouts replaced
    resamples: int = 0  # sequences generated
    seconds: float = 0.0


def _merge(record: str | None, lope: dict) -> str:
    base = json.loads(record) if record else {}
    base["lorem_perturb"] = lope
    return json.dumps(base, sort_keys=True)


def lope_rescue(backend: Backend, messages: list[list[dict]], correct: list[list[bool]], groups: list[list[Completion]],
                augmentation: list[list[str | None]], sampling: Sampling, verify_one: Any, n_prefixes: int = 6,
                per_prefix: int = 4, max_groups: int | None = None,
                own_rewards: list[list[float]] | None = None, keys: list[str] | None = None) -> Rescue:
    """Resample every all-fail group (up to `max_groups`, in order) under `n_prefixes` Lorem prefixes x
    `per_prefix` samples in one batched generate call, then replace up to G - 1 failures with the correct
    resamples, in place (`groups`, `correct`, `augmentation`). `verify_one(i, text) -> (reward, correct)`.
    `own_rewards[i][j]`: the reward of the policy's own sample j of group i; a replacement records the one it
    displaced as `own_reward`, because EPS, buckets and the pool score the policy's own samples only
    (tasks/core/eps.py own_samples). Without it, scoring leaves the replaced slots out. `keys[i]` (group i's
    prompt id): each (group, prefix) draws from its own keyed seed, so the resamples do not depend on the batch
    or the worker (tasks/core/seeds.py row_seeds)."""
    stats = Rescue()
    failed = [i for i, c in enumerate(correct) if c and not any(c)]
    if max_groups is not None:
        failed = failed[:max_groups]
    if not failed or n_prefixes < 1 or per_prefix < 1:
        return stats
    prefixes = lorem_prefixes(n_prefixes, sampling.seed)
    jobs = [(i, p) for i in failed for p in range(n_prefixes)]
    rendered = [backend.render([{"role": "system", "content": prefixes[p]}, *messages[i]]) for i, p in jobs]
    lope_sampling = Sampling(sampling.temperature, sampling.top_p, sampling.max_new_tokens, sampling.seed + 7919)
    seeds = row_seeds(lope_sampling.seed, [f"{keys[i]}:lope{p}" for i, p in jobs]) if keys is not None else None
    out = record("lope", backend.generate(rendered, per_prefix, lope_sampling, row_seeds=seeds))
    stats.groups, stats.resamples = len(failed), len(jobs) * per_prefix
    behaviour = {job: text for job, text in zip(jobs, rendered)}
    wins: dict[int, list[tuple[int, Completion]]] = {}
    for (i, p), samples in zip(jobs, out):
        for c in samples:
            if verify_one(i, c.text)[1]:
                wins.setdefault(i, []).append((p, c))
    for i in failed:
        won = wins.get(i, [])
        g = len(groups[i])
        k = min(len(won), g - 1)
        if k:
            stats.rescued += 1
            stats.replaced += k
        attempt = {"replaced": False, "resampled": n_prefixes * per_prefix, "correct": len(won)}
        for j in range(g):
            slot = g - 1 - j  # replace from the end: sample 0 (and any others left) stay failures
            if j < k:
                p, c = won[j]
                groups[i][slot] = c
                correct[i][slot] = True
                augmentation[i][slot] = _merge(augmentation[i][slot], {
                    "replaced": True, "prefix": p, "prefix_words": len(prefixes[p].split()),
                    "behaviour_mean_logprob": c.mean_logprob, "behaviour_prompt": behaviour[(i, p)],
                    **({"own_reward": own_rewards[i][slot]} if own_rewards is not None else {})})
            else:
                augmentation[i][slot] = _merge(augmentation[i][slot], attempt)
    return stats
