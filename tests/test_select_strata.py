"""`select.strata` (tasks/select.py, storage/rounds.py `in_strata`): selection draws only from the named pool strata while the
held-out split stays the whole pool's (the evidence's oracle arm, tasks/compare/arms.py `oracle_sums`); a stratum
the pool does not have, or a split that records none, is refused before the run starts."""

import pytest
from conftest import ROOT, q

PRODUCTS = {"source": "rg:products", "size": 40, "params": {"max_digits": 1}}
SUMS = {"source": "rg:chain_sum", "size": 40, "params": {"min_terms": 2, "max_terms": 2, "max_digits": 1}}
SUMS_NAME = "rg:chain_sum{max_digits=1,max_terms=2,min_terms=2}"


def _sets(*extra: str) -> list[str]:
    import json

    return ["model.policy=tiny-random", "model.backend=scripted", "model.dtype=fp32", "rollout.group_size=4",
            "rollout.max_new_tokens=16", "rollout.fewshot_p0=0.0", "select.batch_size=8", "train.enabled=false",
            "eval.heldout_split=stratified", f"pool.sources={json.dumps([PRODUCTS, SUMS])}", *extra]


@pytest.mark.parametrize("selector", ["uniform", "dapo_filter"])
def test_selection_draws_only_the_named_stratum_and_holds_out_every_one(prefect_api, tmp_path, selector):
    """uniform collects by screening (the default path), whose refills come from the pool, with the ladder
    refining too-hard prompts; dapo_filter draws its generation batches from the pool. Every prompt generated
    for, a refined child included (by its root), is of the stratum."""
    from flows.config import load_config
    from flows.curriculum import curriculum
    from storage.store import Store

    store = Store(tmp_path / "store")
    refine = 'refine.strategies=["ladder"]' if selector == "uniform" else "refine.strategies=[]"
    sets = _sets(f'select.strata=["{SUMS_NAME}"]', f"select.selector={selector}", refine)
    curriculum(load_config(sets=sets, run_id="st", store=store.root, rounds=2))
    generated = q(store, """SELECT r.round, l.stratum, count(DISTINCT r.prompt_id) AS prompts
                            FROM (SELECT run_id, round, prompt_id FROM rollouts UNION ALL
                                  SELECT run_id, round, prompt_id FROM discarded_rollouts) r
                            JOIN (SELECT DISTINCT prompt_id, root_id FROM prompts) p USING (prompt_id)
                            JOIN pool l ON l.prompt_id = p.root_id AND l.run_id = r.run_id AND l.round = 0
                            WHERE r.run_id = 'st' GROUP BY ALL ORDER BY ALL""")
    assert [(r["round"], r["stratum"]) for r in generated] == [(0, SUMS_NAME), (1, SUMS_NAME)]
    assert all(r["prompts"] >= 8 for r in generated)
    held = q(store, "SELECT DISTINCT stratum FROM pool WHERE run_id = 'st' AND round = 0 AND status = 'heldout'")
    assert len(held) == 2  # the held-out set is the whole pool's, products included
    if selector == "uniform":  # the exported curriculum is what the run could draw: the stratum and its children
        import pyarrow.parquet as pq

        from tasks.interop.export_run import export_run

        export_run(store, "st", "trl", str(tmp_path / "cur.parquet"))
        rows = pq.read_table(tmp_path / "cur.parquet").to_pylist()
        roots = {r["prompt_id"]: r["stratum"] for r in q(store, "SELECT prompt_id, stratum FROM pool "
                                                                 "WHERE run_id = 'st' AND round = 0")}
        assert rows and {roots[r["root_id"]] for r in rows} == {SUMS_NAME}
        children = {r["prompt_id"] for r in q(store, """
            SELECT l.prompt_id FROM pool l JOIN (SELECT DISTINCT prompt_id, root_id FROM prompts) p USING (prompt_id)
            WHERE l.run_id = 'st' AND l.round = (SELECT max(round) FROM pool WHERE run_id = 'st')
              AND l.status IN ('active', 'reserve') AND p.prompt_id <> p.root_id""")}
        assert children and children <= {r["prompt_id"] for r in rows}  # the ladder's rungs go with their roots


def test_a_stratum_the_pool_has_not_or_a_flat_split_is_refused():
    from flows.config import load_config

    with pytest.raises(ValueError, match=r"select\.strata names 'rg:products\{max_digits=2\}', no pool source"):
        load_config(sets=_sets('select.strata=["rg:products{max_digits=2}"]'))
    with pytest.raises(ValueError, match=r"select\.strata needs eval\.heldout_split = 'stratified'"):
        load_config(sets=_sets(f'select.strata=["{SUMS_NAME}"]', "eval.heldout_split=flat"))


def test_the_oracle_arm_names_a_stratum_of_the_evidence_design():
    from flows.config import load_config
    from tasks.compare.arms import ARMS

    config = load_config(str(ROOT / "benchmarks" / "evidence.toml"), sets=ARMS["oracle_sums"])
    assert config.select.strata and config.select.selector == "uniform" and config.rollout.screen_samples == 0
