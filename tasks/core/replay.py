"""Replay of recent informative groups (issue 50, item 3; the design's §4b rule): tokens generated once, trained on
again in a later round, corrected for the policy having moved since they were sampled.

Which rows. The informative groups (rewards not all equal) of the run's last R rounds (`replay_rounds`, default
2) whose every row carries its sampled token ids and their log-probs at the sampling temperature (rows without
them, imports and text-only backends, cannot be corrected and are left out), newest round first, groups in a
seeded order inside a round. Whole groups only, since the advantage is relative to the group: the advantage is
computed again from the stored rewards. They fill at most a share rho (`replay_share`) of the round's training
rows: with n fresh rows, at most floor(rho n / (1 - rho)) replayed rows, so that replayed / all <= rho. A LoPE
replacement or a few-shot-assisted row was sampled under another prompt than the one it trains under, so a group
holding one is not replayed.

The correction. A replayed token was sampled by the behaviour policy mu (the checkpoint of its round); the round's
old policy pi_old (this round's starting weights) is what PPO's ratio rho_t = pi_theta / pi_old is taken against.
Each replayed token's clipped surrogate is weighted by the truncated importance weight
w_t = min(pi_old(y_t) / mu(y_t), c) (`replay_weight_cap` c, default 2), detached, as V-trace and IMPALA truncate
it: the expectation is over mu's samples, the truncation bounds the variance a token mu found unlikely would
add. log mu(y_t) is the stored `token_logprobs` (at the rollout temperature); log pi_old(y_t) comes from the old
pass, at the same temperature. A fresh row's weight is 1.
"""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import torch

from tasks.core.ids import RNG_HEX, seed_of
from tasks.core.passes import pad_rows


def replay_budget(fresh_rows: int, share: float) -> int:
    """Replayed rows at most, so that replayed / (fresh + replayed) <= share.

    >>> replay_budget(48, 0.25), replay_budget(48, 0.0), replay_budget(0, 0.25)
    (16, 0, 0)
    """
    if not 0.0 <= share < 1.0:
        raise ValueError(f"replay_share must be in [0, 1), got {share}")
    return int(math.floor(share * fresh_rows / (1.0 - share) + 1e-9))


def _replayable(group: pl.DataFrame) -> bool:
    rewards = group["reward"].to_list()
    if min(rewards) == max(rewards):
        return False
    if group["token_ids"].null_count() or group["token_logprobs"].null_count():
        return False
    if "augmentation" in group.columns:
        aug = group["augmentation"].fill_null("")
        if aug.str.contains("lorem_perturb").any() or aug.str.contains("fewshot_context").any():
            return False
    return all(len(i) == len(lp) and len(i) > 0 for i, lp in zip(group["token_ids"], group["token_logprobs"]))


def pick_replay(earlier: pl.DataFrame, budget: int, seed: int, round: int) -> pl.DataFrame:
    """The replayed rows of round `round` from `earlier` (the run's rollouts of the rounds R before it: round,
    prompt_id, sample_idx, reward, token_ids, token_logprobs, and augmentation if present), whole groups, newest
    round first, at most `budget` rows. The order inside a round is keyed by (seed, round, source round,
    prompt), so two arms at one seed replay alike where their stores agree."""
    if budget <= 0 or earlier.height == 0:
        return earlier.clear()
    chosen: list[pl.DataFrame] = []
    left = budget
    for (source_round,), rows in sorted(earlier.group_by("round"), key=lambda kv: -kv[0][0]):
        groups = {p: g.sort("sample_idx") for (p,), g in rows.group_by("prompt_id")}
        order = sorted(groups, key=lambda p: seed_of(f"{seed}:{round}:replay:{source_round}:{p}", RNG_HEX))
        for p in order:
            g = groups[p]
            if g.height <= left and _replayable(g):
                chosen.append(g)
                left -= g.height
        if left <= 0:
            break
    return pl.concat(chosen) if chosen else earlier.clear()


def truncated_weights(old_logprobs: np.ndarray, behaviour_logprobs: np.ndarray, cap: float) -> np.ndarray:
    """w_t = min(exp(log pi_old - log mu), cap), per token.

    >>> truncated_weights(np.log([0.5, 0.9]), np.log([0.25, 0.3]), 2.0).round(6).tolist()
    [2.0, 2.0]
    >>> truncated_weights(np.log([0.2]), np.log([0.4]), 2.0).round(6).tolist()
    [0.5]
    """
    if cap <= 0:
        raise ValueError(f"replay_weight_cap must be > 0, got {cap}")
    return np.minimum(np.exp(np.asarray(old_logprobs, float) - np.asarray(behaviour_logprobs, float)), cap)


def replay_weights(batch: list, old_logp: torch.Tensor, cap: float, device: str) -> torch.Tensor | None:
    """[B, T] truncated importance weights min(exp(old - mu), cap) for the replayed rows of `batch` (1 elsewhere,
    and past a row's tokens), detached; None when the batch replays nothing."""
    if all(s.behaviour_logprobs is None for s in batch):
        return None
    t = old_logp.shape[1]
    mu = pad_rows([torch.tensor(s.behaviour_logprobs or [], dtype=torch.float32) for s in batch], t, device)
    replayed = torch.tensor([s.behaviour_logprobs is not None for s in batch], device=device)[:, None]
    w = torch.clamp(torch.exp(old_logp.detach().float() - mu), max=cap)
    return torch.where(replayed, w, torch.ones_like(w))
