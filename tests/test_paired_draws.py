"""Arms of a comparison pair by seed: the randomness of few-shot draws and MCMC chains is keyed by (seed, round,
prompt), not by run id (tasks/core/fewshot.py, tasks/shape.py), so two runs at one seed draw the same
demonstrations and make the same MCMC proposals for the same prompt and round, and another seed draws
otherwise (issue 49, item 4)."""

import polars as pl
import pytest
from conftest import ROOT
from golden import RUNS

from flows.config import load_config
from storage.query import sql
from storage.store import Store

DRAWS = {
    "rollouts": "SELECT round, prompt_id, sample_idx, completion, json_extract_string(augmentation, "
                "'$.fewshot_context') AS demos FROM rollouts WHERE run_id = '{run}' ORDER BY ALL",
    "shaped_traces": "SELECT round, prompt_id, origin, text, accept_rate FROM shaped_traces WHERE run_id = '{run}' "
                     "ORDER BY ALL",
}


@pytest.fixture(scope="module")
def runs(prefect_api, tmp_path_factory):
    """The scripted golden run without training (few-shot context always on, MCMC shaping on), twice at seed 0
    under two run ids, and once with other sampling and shaping seeds, in one store."""
    import os

    from flows.curriculum import curriculum

    here = os.getcwd()
    os.chdir(ROOT)  # the pool names its source file relative to the repository
    try:
        store = Store(tmp_path_factory.mktemp("paired") / "store")
        for run_id, seeds in (("arm-a", []), ("arm-b", []), ("other", ["rollout.seed=1", "shape.seed=1"])):
            curriculum(load_config(sets=[*RUNS["resume"]["sets"], *seeds], run_id=run_id, store=store.root,
                                   rounds=2))
    finally:
        os.chdir(here)
    return store


def _draws(store, table: str, run: str) -> pl.DataFrame:
    return pl.from_arrow(sql(store, DRAWS[table].format(run=run)))


@pytest.mark.parametrize("table", list(DRAWS))
def test_two_runs_at_one_seed_draw_alike_and_another_seed_does_not(runs, table):
    a, b, other = (_draws(runs, table, r) for r in ("arm-a", "arm-b", "other"))
    assert a.height > 0
    assert a.equals(b)
    assert not a.equals(other)


def test_the_draws_compared_are_there(runs):
    demos = sql(runs, "SELECT count(*) AS n FROM rollouts WHERE run_id = 'arm-a' AND round = 1 AND "
                      "augmentation LIKE '%fewshot_context%'").to_pylist()[0]["n"]
    moved = sql(runs, "SELECT count(*) AS n FROM shaped_traces WHERE run_id = 'arm-a' AND accept_rate > 0"
                ).to_pylist()[0]["n"]
    assert demos > 0 and moved > 0  # demonstrations were drawn and chains moved: the equality above says something
