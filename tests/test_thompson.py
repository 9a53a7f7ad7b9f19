"""The `thompson` selector (tasks/selectors/thompson.py) on the scripted policy: after one round in which a bin's
prompts all failed, selection stops drawing that bin except at its floor, and the predictions it made land in
`predictions`, where SQL sets them beside what happened."""

from pathlib import Path

import pytest
from conftest import q


@pytest.fixture(scope="module")
def run(prefect_api, tmp_path_factory):
    from test_scripted_flow import _unsolved_source

    from flows.config import load_config
    from flows.curriculum import curriculum
    from storage.store import Store

    folder = tmp_path_factory.mktemp("thompson")
    store = Store(folder / "store")
    unsolved = _unsolved_source(folder)
    sets = ["model.policy=tiny-random", "model.backend=scripted", "model.dtype=fp32", "rollout.group_size=4",
            "rollout.max_new_tokens=32", "rollout.fewshot_p0=0.0", "rollout.include_reserve=true",
            "select.selector=thompson", "select.embedder=hashing", "select.batch_size=8", "refine.strategies=[]",
            "shape.enabled=false", "train.enabled=false", "eval.enabled=false", "governor.enabled=false",
            "rollout.screen_samples=0",  # the selector's picks alone, each scored at G (no screening refills)
            f'pool.sources=[{{"source": "{unsolved}"}}, '
            '{"source": "rg:products", "size": 40, "params": {"max_digits": 1}}]']
    curriculum(load_config(sets=sets, run_id="ts", store=store.root, rounds=3))
    return store, Path(unsolved).name  # prompts.source names a file source by its file name


def _picks(store, source: str) -> dict[int, list[dict]]:
    rows = q(store, f"""SELECT s.round, s.reason FROM selections s JOIN prompts p USING (prompt_id)
                        WHERE s.run_id = 'ts' AND p.source = '{source}' ORDER BY s.round""")
    out: dict[int, list[dict]] = {}
    for r in rows:
        out.setdefault(r["round"], []).append(r)
    return out


def test_an_all_fail_bin_is_drawn_only_at_its_floor_after_one_round(run):
    store, unsolved = run
    fails = q(store, f"""SELECT max(s.mean_reward) AS best, count(*) AS groups FROM prompt_scores s
                         JOIN prompts p USING (prompt_id) WHERE s.run_id = 'ts' AND p.source = '{unsolved}'""")[0]
    assert fails["groups"] >= 2 and fails["best"] == 0  # the bin only ever failed
    picks = _picks(store, unsolved)
    assert len(picks[0]) >= 2  # round 0 knows nothing: the bin is drawn like any other
    for r in (1, 2):
        assert len(picks[r]) == 1 and picks[r][0]["reason"].startswith("floor"), picks.get(r)


def test_predictions_land_for_every_candidate_and_calibrate_in_sql(run):
    store, unsolved = run
    per_round = q(store, """SELECT p.round, count(*) AS candidates, count(*) FILTER (WHERE picked) AS picked,
                                   (SELECT count(*) FROM selections s WHERE s.run_id = 'ts' AND s.round = p.round)
                                   AS selected
                            FROM predictions p WHERE p.run_id = 'ts' GROUP BY p.round ORDER BY p.round""")
    assert [r["round"] for r in per_round] == [0, 1, 2]
    assert all(r["picked"] == r["selected"] == 8 and r["candidates"] > 8 for r in per_round)
    calib = q(store, f"""SELECT pr.source = '{unsolved}' AS hard, avg(p.predicted_pass_rate) AS predicted,
                                avg(s.mean_reward) AS observed, avg(p.predicted_informative) AS informative
                         FROM predictions p JOIN prompt_scores s USING (run_id, round, prompt_id)
                         JOIN prompts pr USING (prompt_id) WHERE p.run_id = 'ts' AND p.round >= 1 GROUP BY ALL""")
    hard = next(c for c in calib if c["hard"])
    easy = next(c for c in calib if not c["hard"])
    assert hard["observed"] == 0 and hard["predicted"] < 0.25 < easy["predicted"]
    assert hard["informative"] < easy["informative"]
