import json

import polars as pl
import pytest

from tasks.fewshot import fewshot_messages, fewshot_probability


def _prompts(n, source="rg:products"):
    return pl.DataFrame({"prompt_id": [f"p{i}" for i in range(n)], "text": [f"Q{i}?" for i in range(n)],
                         "source": [source] * n})


def _demos():
    return pl.DataFrame({"prompt_id": ["p0", "p1", "p2", "z0"], "source": ["rg:products"] * 3 + ["rg:chain_sum"],
                         "question": ["Q0?", "Q1?", "Q2?", "Z?"], "completion": ["A0", "A1", "A2", "AZ"]})


def test_schedule_decays_to_zero():
    got = [fewshot_probability(t, 5, 0.5) for t in range(6)]
    assert got == pytest.approx([0.5, 0.4, 0.3, 0.2, 0.1, 0.0])


def test_demonstrations_are_solved_siblings_never_the_prompt_itself():
    msgs, recs = fewshot_messages(_prompts(3), _demos(), "r", 0, 1, p0=1.0, k=2, instruction="Box it.")
    for i, (m, r) in enumerate(zip(msgs, recs)):
        used = json.loads(r)["fewshot_context"]
        assert len(used) == 2 and f"p{i}" not in used and "z0" not in used  # same source, other prompts
        assert [t["role"] for t in m] == ["user", "assistant", "user", "assistant", "user"]
        assert m[-1]["content"] == f"Q{i}?\nBox it." and m[1]["content"] in ("A0", "A1", "A2")


def test_probability_zero_or_k_zero_or_no_siblings_means_plain_prompts():
    for kwargs in ({"p0": 0.0, "k": 2}, {"p0": 1.0, "k": 0}):
        msgs, recs = fewshot_messages(_prompts(3), _demos(), "r", 0, 1, instruction="", **kwargs)
        assert recs == [None] * 3 and all(len(m) == 1 for m in msgs)
    msgs, recs = fewshot_messages(_prompts(2, "rg:other"), _demos(), "r", 0, 1, p0=1.0, k=2, instruction="")
    assert recs == [None, None]


def test_the_draw_is_seeded_and_follows_p():
    many = _prompts(400)
    a = fewshot_messages(many, _demos(), "r", 1, 2, p0=0.5, k=1, instruction="")[1]
    b = fewshot_messages(many, _demos(), "r", 1, 2, p0=0.5, k=1, instruction="")[1]
    assert a == b
    share = sum(r is not None for r in a) / len(a)
    assert 0.17 < share < 0.33  # p_1 = 0.5 * (1 - 1/2) = 0.25


def test_collect_records_fewshot_demonstrations(store):
    """Round 1 of a run whose round 0 solved some prompts: rollouts carry their demonstrations."""
    import datetime as dt

    import pyarrow as pa
    from test_curriculum import TINY

    from flows.config import load_config
    from storage.query import sql
    from tasks.rollout import collect

    cfg = load_config(sets=[*TINY, "rollout.fewshot_p0=1.0", "rollout.fewshot_k=1", "rollout.lope_prefixes=0"])
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    ids = [f"q{i}" for i in range(3)]
    store.commit("seed", {"prompts": pa.table({
        "prompt_id": ids, "text": [f"What is {i} + 1?" for i in range(3)], "answer": [str(i + 1) for i in range(3)],
        "source": ["rg:chain_sum"] * 3, "root_id": ids, "transform": ["original"] * 3, "created_at": [now] * 3})})
    store.commit("collect", {"rollouts": pa.table({
        "run_id": ["a"] * 3, "round": [0] * 3, "policy_version": [0] * 3, "prompt_id": ids, "sample_idx": [0] * 3,
        "prompt_text": ["x"] * 3, "completion": [r"\boxed{1}", r"\boxed{2}", "no"], "reward": [1.0, 1.0, 0.0],
        "correct": [True, True, False], "n_tokens": [3] * 3, "mean_logprob": [-1.0] * 3,
        "finish_reason": ["stop"] * 3})}, run_id="a", round=0)
    store.commit("pool", {"pool": pa.table({"run_id": ["a"] * 3, "round": [1] * 3, "prompt_id": ids,
                                            "status": ["active"] * 3})}, run_id="a", round=1)
    collect(store, "a", 1, 0, cfg.model, cfg.rollout, cfg.reward, use_selection=False, rounds=4)
    rows = sql(store, "SELECT prompt_id, any_value(augmentation) AS aug, any_value(prompt_text) AS p, count(*) AS n "
                      "FROM rollouts WHERE round = 1 GROUP BY 1 ORDER BY 1").to_pylist()
    assert [r["n"] for r in rows] == [4, 4, 4]
    for r in rows:  # p_1 = 1.0 * (1 - 1/4) < 1, so a prompt may go without; those that got one show it
        if r["aug"]:
            (demo,) = json.loads(r["aug"])["fewshot_context"]
            assert demo in ("q0", "q1") and demo != r["prompt_id"]
            assert r"\boxed{" in r["p"]  # the demonstration's solved completion is in the rendered prompt
    assert any(r["aug"] for r in rows)
