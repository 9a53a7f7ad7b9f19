"""The rescore flow: a completed run's reserve pool re-sampled with its newest checkpoint, and the next round's
pool following the new scores."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from conftest import run_cli as _cli  # noqa: E402
from test_curriculum import TINY  # noqa: E402

from flows.config import load_config  # noqa: E402
from storage.query import sql  # noqa: E402

# The scripted policy (models/scripted.py) on the tiny model's weights: it solves each prompt at a known rate
# that rises by 1/8 per trained version, so reserve prompts that were too_hard at version 0 are informative
# again when version 2 rescores them, while saturated ones stay saturated. Its answers need more than 4
# tokens; LoPE is off so that all-fail groups stay too_hard; every active prompt is collected.
SETS = [s for s in TINY if not s.startswith(("rollout.include_reserve", "rollout.max_new_tokens", "select.batch_size",
                                             "pool.sources"))] + [
    "rollout.include_reserve=false", "model.backend=scripted", "rollout.max_new_tokens=40", "rollout.lope_prefixes=0",
    "select.batch_size=16",
    'pool.sources=[{"source": "rg:products", "size": 8, "params": {"max_digits": 1}}, '
    '{"source": "rg:chain_sum", "size": 8, "params": {"max_terms": 2, "max_digits": 1}}]']


@pytest.mark.slow
def test_rescore_reserve_then_the_next_round_follows_it(prefect_api, store):
    from flows.curriculum import curriculum
    from flows.rescore import rescore

    assert rescore(store=store.root)["skipped"].startswith("the store")  # a schedule before any run: a no-op
    with pytest.raises(ValueError, match="run 'nope' is not in the store"):
        rescore(run_id="nope", store=store.root)
    curriculum(load_config(sets=SETS, run_id="rs", store=store.root, rounds=2))
    reserve = set(sql(store, "SELECT prompt_id FROM pool WHERE run_id = 'rs' AND round = 1 AND status = 'reserve'"
                      ).column("prompt_id").to_pylist())
    assert reserve  # round 0's collected originals that were not informative went to reserve
    newest = sql(store, "SELECT max(policy_version) AS v FROM checkpoints WHERE run_id = 'rs'").to_pylist()[0]["v"]
    assert newest == 2

    code, out, err = _cli("rescore", "--run-id", "rs", "--store", store.root)
    assert code == 0, err
    assert f"run rs round 1: rescored {len(reserve)} reserve prompts with v2 (" in out
    rows = sql(store, """SELECT prompt_id, policy_version, count(*) AS n FROM rollouts
                         WHERE run_id = 'rs' AND round = 1 AND augmentation LIKE '%"rescore"%' GROUP BY ALL""")
    assert {r["prompt_id"] for r in rows.to_pylist()} == reserve
    assert all(r["n"] == 4 and r["policy_version"] == 2 for r in rows.to_pylist())
    scores = {r["prompt_id"]: r["bucket"] for r in sql(
        store, "SELECT prompt_id, bucket FROM prompt_scores WHERE run_id = 'rs' AND round = 1 AND policy_version = 2"
    ).to_pylist()}
    assert set(scores) == reserve
    assert "informative" in scores.values()  # version 2 recovers some: the reactivation below is exercised
    assert sql(store, """SELECT count(*) AS n FROM (SELECT round, prompt_id FROM prompt_scores WHERE run_id = 'rs'
                         GROUP BY ALL HAVING count(*) > 1)""").to_pylist() == [{"n": 0}]  # one score per round
    # the report's per-round distributions keep to the round's own scores
    from tasks.report import run_frames

    collected = sql(store, "SELECT count(DISTINCT prompt_id) AS n FROM rollouts WHERE run_id = 'rs' AND round = 1 "
                           "AND (augmentation IS NULL OR augmentation NOT LIKE '%\"rescore\"%')").to_pylist()[0]["n"]
    assert run_frames(store, "rs")["scores"].filter(round=1).height == collected
    # the same checkpoint again: nothing resampled
    code, out, _ = _cli("rescore", "--run-id", "rs", "--store", store.root)
    assert code == 0 and "v2 already rescored" in out
    assert sql(store, "SELECT count(*) AS n FROM rollouts WHERE augmentation LIKE '%\"rescore\"%'"
               ).to_pylist() == [{"n": 4 * len(reserve)}]

    # extending the run: round 2's pool takes the rescored buckets (informative -> active, else reserve)
    curriculum(load_config(sets=SETS, run_id="rs", store=store.root, rounds=3))
    status = {r["prompt_id"]: r["status"] for r in sql(
        store, "SELECT prompt_id, status FROM pool WHERE run_id = 'rs' AND round = 2").to_pylist()}
    assert {p: status[p] for p in reserve} == {p: "active" if b == "informative" else "reserve"
                                               for p, b in scores.items()}
    assert "active" in {status[p] for p in reserve}


def test_rescore_refuses_a_run_that_did_not_complete(prefect_api, store):
    from storage.runs import mark

    mark(store, "half", "running", load_config(sets=SETS, run_id="half").model_dump(mode="json"))
    code, _, err = _cli("rescore", "--run-id", "half", "--store", store.root)
    # taking the lock finds the dead 'running' row and marks it failed; a failed run is not rescored
    assert code == 1 and "run half is failed, not completed; resume it" in err
    assert sql(store, "SELECT status FROM runs WHERE run_id = 'half' ORDER BY created_at"
               ).column("status").to_pylist() == ["running", "failed"]


def test_a_live_run_is_left_to_the_lock_by_the_check_before_the_flow(store):
    """Before the flow (no lock) a live status passes: the run may be alive or dead, and only taking its lock
    tells (and marks a dead one failed). Under the lock the same status is refused. A resumed run's rows end
    in `resumed`, which is live too."""
    from storage.runs import mark
    from tasks.rescore import check_rescorable

    config = load_config(sets=SETS, run_id="again").model_dump(mode="json")
    for _ in range(2):  # the second mark of a run is `resumed`
        mark(store, "again", "running", config)
    assert sql(store, "SELECT status FROM runs WHERE run_id = 'again' ORDER BY created_at"
               ).column("status").to_pylist() == ["running", "resumed"]
    check_rescorable(store, "again", under_lock=False)
    with pytest.raises(ValueError, match="run again is resumed, not completed"):
        check_rescorable(store, "again")
    mark(store, "again", "failed", config)
    with pytest.raises(ValueError, match="run again is failed, not completed"):
        check_rescorable(store, "again", under_lock=False)
