"""The budget governor (tasks/core/governor.py, tasks/govern.py): the rule on its own, a scripted run whose LoPE
rescues nothing being throttled to one group, and a store whose component recovers being restored."""

import json

import pyarrow as pa
import pytest
from conftest import q, round_ctx

from tasks.core.governor import Measure, decide

G = 4


def test_the_rule_throttles_after_patience_rounds_below_and_restores_after_one_above():
    base = Measure(0, 1000, 10.0)
    low, high, idle = Measure(0, 1000, 1.0), Measure(0, 1000, 50.0), Measure(0, 0, 0.0)
    assert decide([(low, base)], False) == (False, "keep", 1)
    assert decide([(low, base), (low, base)], False) == (True, "throttle", 2)
    assert decide([(low, base), (idle, base), (low, base)], False) == (True, "throttle", 2)  # idle: no verdict
    assert decide([(low, base), (high, base), (low, base)], False) == (False, "keep", 1)
    assert decide([(low, base), (low, base), (high, base)], True) == (False, "restore", 0)
    assert decide([(low, base), (low, base), (idle, base)], True) == (True, "idle", 2)
    assert decide([(low, base)] * 3, False, patience=3) == (True, "throttle", 3)


def test_a_scripted_run_throttles_a_lope_that_pays_less_than_rollouts(prefect_api, tmp_path):
    """Half the pool is prompts the scripted policy never solves: LoPE spends its tokens mostly on them and
    makes fewer training rows per 1k tokens than plain rollouts in rounds 0 and 1, so round 2 holds it at one
    group."""
    from test_scripted_flow import _unsolved_source

    from flows.config import load_config
    from flows.curriculum import curriculum
    from storage.store import Store

    store = Store(tmp_path / "store")
    sets = ["model.policy=tiny-random", "model.backend=scripted", "model.dtype=fp32", f"rollout.group_size={G}",
            "rollout.max_new_tokens=32", "rollout.fewshot_p0=0.0", "rollout.lope_prefixes=6",
            "rollout.lope_max_groups=4", "select.selector=all", "refine.strategies=[]", "shape.enabled=false",
            "eval.enabled=false", "train.enabled=false",
            f'pool.sources=[{{"source": "{_unsolved_source(tmp_path)}"}}, '
            '{"source": "rg:products", "size": 8, "params": {"max_digits": 1}}]']
    curriculum(load_config(sets=sets, run_id="gv", store=store.root, rounds=3))
    rows = q(store, "SELECT * FROM governor WHERE run_id = 'gv' AND component = 'lope' ORDER BY round")
    assert [r["decision"] for r in rows] == ["start", "keep", "throttle"], rows
    assert rows[2]["throttled"] and rows[2]["yield_per_1k"] < rows[2]["baseline_per_1k"]
    assert rows[1]["yield_per_1k"] < rows[1]["baseline_per_1k"]  # round 0's figures, read before round 1
    lope = {r["round"]: r["completions"] for r in q(store, """SELECT round, sum(completions)::BIGINT AS completions
             FROM generated_tokens WHERE run_id = 'gv' AND purpose = 'lope' GROUP BY round""")}
    assert lope[1] > lope[2] > 0  # round 2 resamples one group's worth, rounds 0 and 1 up to four


def _land_round(store, run: str, r: int, rollout_tokens: int, informative: int, lope_tokens: int, rescued: int):
    """One round of a run as the collect and score stages land it: informative groups of G, and LoPE-rescued
    groups (an all-fail group with one replaced rollout)."""
    scores, rollouts = [], []
    for i in range(informative + rescued):
        pid = f"p{r}-{i}"
        scores.append({"run_id": run, "round": r, "policy_version": 0, "prompt_id": pid, "n": G, "mean_reward": 0.5,
                       "std_reward": 0.5, "eps": 0.1, "bucket": "informative" if i < informative else "too_hard"})
        for s in range(G):
            aug = json.dumps({"lorem_perturb": {"replaced": True}}) if i >= informative and s == 0 else None
            rollouts.append({"run_id": run, "round": r, "policy_version": 0, "prompt_id": pid, "sample_idx": s,
                             "prompt_text": "q", "completion": "a", "reward": 1.0 if s == 0 else 0.0,
                             "correct": s == 0, "n_tokens": 3, "mean_logprob": -1.0, "finish_reason": "stop",
                             "augmentation": aug})
    tokens = [{"run_id": run, "round": r, "stage": "collect", "purpose": p, "calls": 1, "completions": 1,
               "tokens": t} for p, t in (("rollout", rollout_tokens), ("lope", lope_tokens)) if t]
    from storage.schemas import schema

    store.commit("collect", {"rollouts": pa.Table.from_pylist(rollouts, schema=schema("rollouts")),
                             "prompt_scores": pa.Table.from_pylist(scores, schema=schema("prompt_scores")),
                             "generated_tokens": pa.Table.from_pylist(tokens, schema=schema("generated_tokens"))},
                 run_id=run, round=r)


def test_a_throttled_component_that_recovers_is_restored(store):
    """LoPE yields 4 rows per 1k tokens against the baseline's 40 in rounds 0 and 1 (throttled for round 2), then
    400 in round 2 (restored for round 3); the held config follows."""
    from tasks.core.governor import GovernorConfig
    from tasks.govern import govern_task, governor_rows, held_sections
    from tasks.sampling.rollouts import RolloutConfig

    figures = {0: (1000, 10, 1000, 1), 1: (1000, 10, 1000, 1), 2: (1000, 10, 10, 1)}
    decisions, held = [], []
    for r in range(4):
        govern_task.fn(round_ctx(store, "rv", r), GovernorConfig())
        row = governor_rows(store, "rv", r).filter(component="lope").to_dicts()[0]
        decisions.append(row["decision"])
        held.append(held_sections(store, "rv", r, {"rollout": RolloutConfig(lope_max_groups=4)})["rollout"]
                    .lope_max_groups)
        if r in figures:
            _land_round(store, "rv", r, *figures[r])
    assert decisions == ["start", "keep", "throttle", "restore"]
    assert held == [4, 4, 1, 4]
    row = governor_rows(store, "rv", 2).filter(component="lope").to_dicts()[0]
    assert row["yield_per_1k"] == pytest.approx(4.0) and row["baseline_per_1k"] == pytest.approx(40.0)
