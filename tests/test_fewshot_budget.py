"""Few-shot context annealed over a token budget (issue 50 item 5): p_t = p0 * (1 - spent / budget) when a budget is
set, the rounds form p0 * (1 - t / T) otherwise."""

import json

import polars as pl
import pytest

from tasks.core.fewshot import fewshot_messages, fewshot_probability


def _prompts(n):
    return pl.DataFrame({"prompt_id": [f"p{i}" for i in range(n)], "text": [f"Q{i}?" for i in range(n)],
                         "source": ["rg:products"] * n, "root_id": [f"p{i}" for i in range(n)]})


def _demos():
    return pl.DataFrame({"prompt_id": ["d0", "d1"], "source": ["rg:products"] * 2, "root_id": ["d0", "d1"],
                         "question": ["D0?", "D1?"], "completion": ["A0", "A1"]})


def test_the_budget_form_follows_spent_tokens_not_rounds():
    # a run of rounds = 12 stopped by a 60k budget: the rounds form still shows demonstrations at 0.75 p0 in
    # round 3; the budget form reaches 0 as the budget is spent, whatever the round
    assert fewshot_probability(3, 12, 0.5) == pytest.approx(0.375)
    got = [fewshot_probability(3, 12, 0.5, spent=s, budget=60_000) for s in (0, 15_000, 45_000, 60_000, 75_000)]
    assert got == pytest.approx([0.5, 0.375, 0.125, 0.0, 0.0])
    assert fewshot_probability(3, 12, 0.5, spent=None, budget=None) == fewshot_probability(3, 12, 0.5)


@pytest.mark.parametrize("spent,budget", [(None, 100), (-1, 100), (10, 0)])
def test_a_budget_without_a_spend_or_a_positive_size_is_refused(spent, budget):
    with pytest.raises(ValueError, match="token budget"):
        fewshot_probability(0, 4, 0.5, spent=spent, budget=budget)


def test_messages_draw_at_the_budget_probability_and_record_it():
    many = _prompts(400)
    early = fewshot_messages(many, _demos(), 0, 1, 2, p0=1.0, k=1, instruction="", spent=0, budget=1000)[1]
    assert all(r is not None for r in early)  # p = 1: round 1 of 2 would have drawn at 0.5
    late = fewshot_messages(many, _demos(), 0, 1, 2, p0=1.0, k=1, instruction="", spent=750, budget=1000)[1]
    share = sum(r is not None for r in late) / len(late)
    assert 0.17 < share < 0.33 and {json.loads(r)["p"] for r in late if r} == {0.25}
    spent_all = fewshot_messages(many, _demos(), 0, 0, 2, p0=1.0, k=1, instruction="", spent=1000, budget=1000)[1]
    assert spent_all == [None] * 400


def test_a_budgeted_run_anneals_few_shot_over_its_tokens(prefect_api, tmp_path):
    """A scripted run with a token budget records, on every demonstration-carrying rollout of round r,
    p = p0 * (1 - spent_r / budget), spent_r being the run's non-evaluation tokens of rounds before r (SQL)."""
    from conftest import q

    from flows.config import load_config
    from flows.curriculum import curriculum
    from storage.store import Store

    store = Store(tmp_path / "store")
    budget = 100_000
    sets = ["model.policy=tiny-random", "model.backend=scripted", "model.dtype=fp32", "rollout.group_size=4",
            "rollout.max_new_tokens=32", "rollout.fewshot_p0=1.0", "select.selector=uniform", "select.batch_size=12",
            "refine.strategies=[]", "shape.enabled=false", "eval.enabled=false", f"max_generated_tokens={budget}",
            'pool.sources=[{"source": "rg:products", "size": 24, "params": {"max_digits": 1}}]']
    curriculum(load_config(sets=sets, run_id="fs", store=store.root, rounds=3))
    rows = q(store, """SELECT r.round, json_extract(r.augmentation, '$.p')::DOUBLE AS p,
                              (SELECT coalesce(sum(tokens), 0)::BIGINT FROM generated_tokens g
                               WHERE g.run_id = r.run_id AND g.round < r.round AND g.purpose != 'eval') AS spent
                       FROM rollouts r
                       WHERE r.run_id = 'fs' AND json_extract(r.augmentation, '$.fewshot_context') IS NOT NULL""")
    assert rows and {r["round"] for r in rows} >= {1, 2}
    for r in rows:
        assert r["spent"] > 0 and r["p"] == pytest.approx(1.0 - r["spent"] / budget), r
    assert len({round(r["p"], 9) for r in rows}) == len({r["round"] for r in rows})  # one p per round
