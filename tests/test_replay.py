"""Replay of recent informative groups (tasks/core/replay.py): which rows, the truncated importance weight against
a direct computation, and a scripted run that replays round 0's groups in round 1 and records the share."""

import math

import numpy as np
import polars as pl
import pytest
import torch

from tasks.core.grpo import Sequence, grpo_token_terms
from tasks.core.replay import pick_replay, replay_budget, replay_weights, truncated_weights


def _rows(round: int, prompt: str, rewards: list[float], aug: str | None = None, ids: bool = True) -> list[dict]:
    return [{"round": round, "prompt_id": prompt, "sample_idx": i, "reward": r, "augmentation": aug,
             "token_ids": [5, 6] if ids else None, "token_logprobs": [-0.5, -1.0] if ids else None}
            for i, r in enumerate(rewards)]


def _frame(*groups: list[dict]) -> pl.DataFrame:
    return pl.DataFrame([r for g in groups for r in g], schema={
        "round": pl.Int32, "prompt_id": pl.String, "sample_idx": pl.Int32, "reward": pl.Float64,
        "augmentation": pl.String, "token_ids": pl.List(pl.Int32), "token_logprobs": pl.List(pl.Float32)})


def test_picks_whole_informative_groups_newest_round_first_within_the_budget():
    earlier = _frame(_rows(0, "a", [1, 0]), _rows(1, "b", [1, 0]), _rows(1, "flat", [1, 1]),
                     _rows(1, "lope", [1, 0], aug='{"lorem_perturb": {"replaced": true}}'),
                     _rows(1, "shots", [1, 0], aug='{"fewshot_context": ["x"], "p": 0.5}'),
                     _rows(1, "text", [1, 0], ids=False), _rows(0, "c", [0, 1]))
    picked = pick_replay(earlier, budget=4, seed=0, round=2)
    groups = [(r, p) for r, p in picked.select("round", "prompt_id").unique(maintain_order=True).iter_rows()]
    assert groups[0] == (1, "b") and len(groups) == 2 and groups[1][0] == 0  # round 1's one replayable group first
    assert picked.height == 4 and picked.group_by("round", "prompt_id").len()["len"].to_list() == [2, 2]
    assert pick_replay(earlier, budget=3, seed=0, round=2).height == 2  # whole groups only
    assert pick_replay(earlier, budget=0, seed=0, round=2).height == 0
    assert pick_replay(earlier, 4, 0, 2).equals(picked)  # deterministic
    assert replay_budget(48, 0.25) == 16 and 16 / (48 + 16) == 0.25


def test_the_weighted_surrogate_equals_a_direct_computation():
    """A replayed token's clipped surrogate is weighted by min(pi_old / mu, c); a fresh row's is not."""
    logp = torch.tensor([[-0.4, -1.1, -2.0], [-0.3, -0.9, -1.5]])
    old = torch.tensor([[-0.5, -1.0, -2.2], [-0.2, -1.0, -1.4]])
    mu = [-1.5, -0.7, -2.2]  # row 0 was sampled by an earlier policy
    batch = [Sequence([1], [2, 3, 4], 1.0, behaviour_logprobs=mu), Sequence([1], [2, 3, 4], -0.5)]
    w = replay_weights(batch, old, cap=2.0, device="cpu")
    mask = torch.ones(2, 3)
    adv = torch.tensor([1.0, -0.5])
    terms = grpo_token_terms(logp, old, None, adv, mask, torch.tensor([False, False]), 0.2, 0.28, 0.0, 10.0, w)
    want = 0.0
    for b in range(2):
        for t in range(3):
            rho = math.exp(logp[b, t] - old[b, t])
            a = float(adv[b])
            pg = -min(rho * a, min(max(rho, 0.8), 1.28) * a)
            weight = min(math.exp(old[0, t] - mu[t]), 2.0) if b == 0 else 1.0
            want += pg * weight
    assert float(terms["pg"]) == pytest.approx(want, rel=1e-5)
    assert w[0].tolist() == pytest.approx(truncated_weights(old[0].numpy(), np.array(mu), 2.0).tolist())
    assert w[1].tolist() == [1.0, 1.0, 1.0]
    assert replay_weights(batch[1:], old[1:], 2.0, "cpu") is None


def test_a_scripted_run_replays_round_zeros_groups_and_records_the_share(prefect_api, tmp_path):
    from conftest import q

    from flows.config import load_config
    from flows.curriculum import curriculum
    from storage.store import Store

    store = Store(tmp_path / "store")
    sets = ["model.policy=tiny-random", "model.backend=scripted", "model.dtype=fp32", "rollout.group_size=4",
            "rollout.max_new_tokens=32", "rollout.fewshot_p0=0.0", "select.selector=uniform", "select.batch_size=12",
            "refine.strategies=[]", "shape.enabled=false", "eval.enabled=false", "train.replay_share=0.25",
            "train.rows_per_step=16", 'pool.sources=[{"source": "rg:products", "size": 24, "params": {"max_digits": 1}}]']
    out = curriculum(load_config(sets=sets, run_id="rp", store=store.root, rounds=2))
    steps = q(store, "SELECT round, replay_share FROM train_steps WHERE run_id = 'rp' ORDER BY round, step")
    assert {s["replay_share"] for s in steps if s["round"] == 0} == {0.0}
    later = [s["replay_share"] for s in steps if s["round"] == 1]
    assert later and max(later) > 0
    informative = q(store, """SELECT count(*) AS n FROM prompt_scores
                              WHERE run_id = 'rp' AND round = 0 AND bucket = 'informative'""")[0]["n"]
    train = [s for s in out["stages"] if s.get("stage") == "train" and s.get("round") == 1]
    assert informative > 0 and len(train) == 1
    replayed = train[0]["replayed"]  # whole groups of 4, at most a quarter of the round's training rows
    assert replayed > 0 and replayed % 4 == 0 and replayed <= train[0]["sequences"] * 0.25 + 1e-9
