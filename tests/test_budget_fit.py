"""A token budget's last round selects what fits what is left (tasks/core/budget.py, issue 50): the run ends
within about a prompt's tokens of its budget instead of up to a round past it, is evaluated at that end, and a
resume fits the same rounds alike."""

import pytest
from conftest import q

from flows.config import load_config
from flows.curriculum import curriculum
from storage.store import Store
from tasks.core.budget import Fit, fitted_batches

BATCH = 8
SETS = ["model.policy=tiny-random", "model.backend=scripted", "model.dtype=fp32", "rollout.group_size=4",
        "rollout.max_new_tokens=40", "select.selector=uniform", f"select.batch_size={BATCH}",
        "shape.enabled=false", "governor.enabled=false", "eval.milestone_tokens=1000000",
        'pool.sources=[{"source": "rg:products", "size": 40, "params": {"max_digits": 1}}]']


def test_the_last_round_gets_the_picks_that_fit_and_none_follows_it():
    # 10,000 of 12,000 spent after two rounds of 5,000 (125 per pick of 40): 2,000 left buys 16 of 40
    assert fitted_batches([5000, 5000], 12_000, 40) == [Fit(40, False), Fit(40, False), Fit(16, True)]
    # what is left buys less than half a pick: the next round does not run
    assert fitted_batches([5000, 5000], 10_060, 40)[2] == Fit(0, True)
    # a round that reached the budget, or came after the last, is followed by none
    assert fitted_batches([5000, 5200], 10_000, 40)[2] == Fit(0, True)
    assert fitted_batches([5000, 5000, 1900], 12_000, 40)[3] == Fit(0, True)
    # a batch of 1 still gets its last round when what is left buys more than half of it
    assert fitted_batches([100, 100], 260, 1)[2] == Fit(1, True)
    # the cost per pick is the round before's: a fitted round's own cost is per its fitted batch
    assert fitted_batches([4000, 2000], 10_000, 40)[2] == Fit(40, False)  # 50 per pick: 4,000 left fits 80
    with pytest.raises(ValueError, match="token budget"):
        fitted_batches([1], 0, 40)


def _per_round(store, table: str, run: str) -> list[int]:
    what = "sum(tokens)" if table == "generated_tokens" else "count(*)"
    # the select stage's picks (screening's refills land in `selections` too)
    where = " AND purpose <> 'eval'" if table == "generated_tokens" else " AND reason NOT LIKE '%screening refill%'"
    rows = q(store, f"SELECT round, {what} AS n FROM {table} WHERE run_id = '{run}'{where} GROUP BY round "
                    "ORDER BY round")
    return [int(r["n"]) for r in rows]


def test_a_budgeted_run_ends_at_its_budget_evaluated_and_resumes_alike(prefect_api, tmp_path):
    """Two rounds without a budget tell a round's tokens; resumed with a budget half a round past them, the third
    round selects half the batch and is the last (the rule before it ran the whole round: half a round over),
    its checkpoint is evaluated at the run's tokens, it refines nothing (children of the last round never run),
    and a resume with more rounds adds nothing."""
    store = Store(tmp_path / "store")
    curriculum(load_config(sets=SETS, run_id="fit", store=store.root, rounds=2))
    t0, t1 = _per_round(store, "generated_tokens", "fit")
    per_pick = t1 / BATCH
    budget = t0 + t1 + round(3.6 * per_pick)  # about 3.6 picks left: round() fits 3 or 4 of 8
    curriculum(load_config(sets=[*SETS, f"max_generated_tokens={budget}"], run_id="fit", store=store.root,
                           rounds=6))
    tokens = _per_round(store, "generated_tokens", "fit")
    assert len(tokens) == 3, tokens
    # the resume first refined round 1 (its refine was pending: see below), so round 1 cost a little more
    fits = round((budget - tokens[0] - tokens[1]) / (tokens[1] / BATCH))
    assert 1 <= fits < BATCH and _per_round(store, "selections", "fit") == [BATCH, BATCH, fits], tokens
    assert abs(sum(tokens) - budget) < 2 * per_pick, (tokens, budget, per_pick)
    run = q(store, "SELECT status, reason FROM runs WHERE run_id = 'fit' ORDER BY created_at")[-1]
    assert run["status"] == "completed" and run["reason"].startswith("token budget reached"), run
    assert "stopped before round 3" in run["reason"]
    last_eval = q(store, "SELECT policy_version, generated_tokens FROM evals WHERE run_id = 'fit' AND "
                         "split = 'heldout' ORDER BY policy_version DESC LIMIT 1")
    assert last_eval == [{"policy_version": 3, "generated_tokens": sum(tokens)}]
    # rounds=2 made round 1 the last then: a resume that raised the limit refined it, as it does with `rounds`
    assert [store.landed("fit", r, "refine") for r in range(3)] == [True, True, False]
    curriculum(load_config(sets=[*SETS, f"max_generated_tokens={budget}"], run_id="fit", store=store.root,
                           rounds=8))
    assert _per_round(store, "generated_tokens", "fit") == tokens


@pytest.mark.parametrize("budget,ends,why", [
    (1630, True, "the 30 tokens left of max_generated_tokens 1630 buy less than half a prompt"),
    (1700, False, None),  # 100 left buys one pick of 100: round 2 runs, 1 prompt, and is the last
    (1500, True, ">= max_generated_tokens 1500")])
def test_a_round_that_leaves_less_than_half_a_pick_ends_the_run_and_is_evaluated_as_its_end(store, budget, ends,
                                                                                            why):
    """Round 1 ends within half a pick of the budget: no round follows, so round 1 is the run's end (the flow
    evaluates its checkpoint as the run's last), and the run stops before round 2 saying why."""
    from test_round_summary import _tokens

    from flows.curriculum import budget_ends, budget_fit
    from tasks.reporting.budget import tokens_by_round

    _tokens(store, [(0, "rollout", 800), (1, "rollout", 800), (1, "eval", 5000)])  # 100 tokens per pick of 8
    tokens = tokens_by_round(store, "r", 2)
    assert tokens == [800, 800]  # evaluation never counts
    cfg = load_config(sets=[*SETS, f"max_generated_tokens={budget}"], run_id="r", store=store.root)
    assert budget_ends(cfg, tokens) is ends
    fit, stop = budget_fit(cfg, tokens)
    assert (stop is not None) is ends and (why is None or why in stop), stop
    if not ends:
        assert fit == Fit(1, True)
