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


def test_posterior_topups_are_measured_from_the_store_and_capped_when_held(store, tmp_path):
    """With every unanimous screen topped up on the posterior's word (threshold 0), the governor's `topup` figures
    are those groups: G rows per one that came out mixed, over the tokens of their top-up samples; held at its
    minimum, a round tops up at most one such screen and screens out the rest."""
    from test_screening import _select_and_collect, scripted

    from storage.store import Store
    from tasks.govern import measures

    out = _select_and_collect(store, "tp", scripted("rollout.screen_topup_threshold=0.0"))
    s = out["screening"]
    assert s["topped_up_posterior"] >= 2 and s["kept"] > 0
    got = measures(store, "tp", 1, screen_samples=2)["topup"][0]
    mixed_topup = q(store, """SELECT coalesce(sum(n_tokens), 0) AS t FROM rollouts r WHERE run_id = 'tp' AND sample_idx >= 2
                              AND (SELECT count(DISTINCT reward) FROM rollouts x WHERE x.run_id = 'tp'
                                   AND x.prompt_id = r.prompt_id AND x.sample_idx < 2) > 1""")[0]["t"]
    assert got.tokens == s["topup_tokens"] - mixed_topup > 0
    assert got.rows == G * (s["topped_up_posterior"] - s["zero_variance"])
    assert measures(store, "tp", 1, screen_samples=0)["topup"][0].tokens == 0  # no screening: idle
    held = Store(tmp_path / "held")
    capped = _select_and_collect(held, "tp", scripted("rollout.screen_topup_threshold=0.0",
                                                      "rollout.screen_posterior_topups=1"))["screening"]
    assert capped["topped_up_posterior"] == 1 and capped["screened_out"] > s["screened_out"]


def test_a_topup_that_pays_less_than_rollouts_is_held_at_one(store):
    """Posterior top-ups that make 8 rows per 1k of their tokens against the baseline's 78 (the rest of collect),
    two rounds running: round 2 holds `rollout.screen_posterior_topups` at 1."""
    from storage.schemas import schema
    from tasks.core.governor import GovernorConfig
    from tasks.govern import govern_task, governor_rows, held_sections
    from tasks.sampling.rollouts import RolloutConfig

    for r in range(2):
        _land_round(store, "tq", r, 1000, 10, 0, 0)  # the baseline: 10 informative groups of G per 1k tokens
        # one posterior top-up kept (unanimous screen 0, 0; top-up 1, 0) and 124 more of its top-up tokens spent on
        # a zero_variance one: G rows over 500 tokens
        rows = [{"run_id": "tq", "round": r, "policy_version": 0, "prompt_id": f"u{r}", "sample_idx": i,
                 "prompt_text": "q", "completion": "a", "reward": [0.0, 0.0, 1.0, 0.0][i], "correct": i == 2,
                 "n_tokens": [3, 3, 1, 375][i], "mean_logprob": -1.0, "finish_reason": "stop"} for i in range(G)]
        gone = [{**row, "prompt_id": f"z{r}", "reward": 0.0, "correct": False, "n_tokens": [3, 3, 62, 62][row["sample_idx"]],
                 "gen_batch": 0, "reason": "zero_variance"} for row in rows]
        kept = [{"run_id": "tq", "round": r, "policy_version": 0, "prompt_id": f"u{r}", "n": G, "mean_reward": 0.25,
                 "std_reward": 0.43, "eps": 0.1, "bucket": "informative"}]  # the top-up made it mixed
        store.commit("collect-more", {
            "rollouts": pa.Table.from_pylist(rows, schema=schema("rollouts")),
            "prompt_scores": pa.Table.from_pylist(kept, schema=schema("prompt_scores")),
            "discarded_rollouts": pa.Table.from_pylist(gone, schema=schema("discarded_rollouts")),
            "generated_tokens": pa.Table.from_pylist([{"run_id": "tq", "round": r, "stage": "collect",
                                                       "purpose": "screen", "calls": 1, "completions": 4, "tokens": 12}],
                                                     schema=schema("generated_tokens"))}, run_id="tq", round=r)
    for r in range(3):
        govern_task.fn(round_ctx(store, "tq", r), GovernorConfig(), 2)
    row = governor_rows(store, "tq", 2).filter(component="topup").to_dicts()[0]
    assert (row["decision"], row["tokens"], row["rows"]) == ("throttle", 500, G)
    assert row["yield_per_1k"] == pytest.approx(8.0) and row["yield_per_1k"] < row["baseline_per_1k"]
    # the baseline without the component's own group and tokens: 10 groups of G over 1000 + 12 - 500 tokens
    assert row["baseline_per_1k"] == pytest.approx(10 * G * 1000 / 512)
    held = held_sections(store, "tq", 2, {"rollout": RolloutConfig()})["rollout"]
    assert held.screen_posterior_topups == 1 and RolloutConfig().screen_posterior_topups > 1


def test_a_run_started_before_a_component_existed_keeps_its_own_set(store):
    """A run whose round 0 governed lope, shape and refine (it predates `topup`) resumes under this version
    without topup rows or throttles; a new run governs every component."""
    from storage.schemas import schema
    from tasks.core.governor import COMPONENTS, GovernorConfig
    from tasks.govern import govern_task, governor_rows

    old = [{"run_id": "old", "round": 0, "component": c.name, "field": c.field, "measured_round": None, "tokens": None,
            "rows": None, "yield_per_1k": None, "baseline_per_1k": None, "below_rounds": 0, "throttled": False,
            "decision": "start"} for c in COMPONENTS if c.name != "topup"]
    store.commit("govern", {"governor": pa.Table.from_pylist(old, schema=schema("governor"))}, run_id="old", round=0)
    _land_round(store, "old", 0, 1000, 10, 0, 0)
    govern_task.fn(round_ctx(store, "old", 1), GovernorConfig(), 2)
    assert sorted(governor_rows(store, "old", 1)["component"].to_list()) == ["lope", "refine", "shape"]
    govern_task.fn(round_ctx(store, "new", 0), GovernorConfig(), 2)
    assert sorted(governor_rows(store, "new", 0)["component"].to_list()) == sorted(c.name for c in COMPONENTS)
