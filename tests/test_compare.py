"""`refinery compare`: one run per (arm, seed) on the same pool and held-out split, seeds paired across arms,
resumable; bad arms refused before anything runs."""

import pytest
from conftest import run_cli
from test_eval_dataset import SETS

from flows.compare import plan
from storage.query import sql
from tasks.compare.arms import ARMS


def test_the_plan_pairs_seeds_across_arms_and_names_each_run():
    runs = plan(["uniform", "refinery"], 2, "p", ["rollout.group_size=4"], {})
    assert [(r.arm, r.seed, r.run_id) for r in runs] == [("uniform", 0, "p-uniform-s0"), ("refinery", 0, "p-refinery-s0"),
                                                         ("uniform", 1, "p-uniform-s1"), ("refinery", 1, "p-refinery-s1")]
    assert runs[0].sets[0] == "rollout.group_size=4" and "select.selector=uniform" in runs[0].sets
    assert runs[2].sets[-4:] == ["rollout.seed=1", "select.seed=1", "shape.seed=1", "train.seed=1"]
    assert not any(s.startswith(("pool.seed", "eval.seed")) for r in runs for s in r.sets)  # shared by all
    mine = plan(["mine"], 1, "p", [], {"mine": [*ARMS["refinery"], "select.temperature=2.0"]})
    assert "select.temperature=2.0" in mine[0].sets
    for arms, seeds, problem in [(["nope"], 1, "unknown arm 'nope'"), (["uniform", "uniform"], 1, "each named once"),
                                 (["uniform"], 0, "--seeds must be >= 1")]:
        with pytest.raises(ValueError, match=problem):
            plan(arms, seeds, "p", [], {})


@pytest.mark.slow
def test_two_arms_two_seeds_share_the_pool_and_heldout_and_resume(prefect_api, store):
    args = ["compare", "--arms", "uniform,refinery", "--seeds", "2", "--prefix", "c", "--rounds", "1",
            "--store", store.root, *[x for s in [*SETS, "eval.n_samples=4"] for x in ("--set", s)]]
    code, out, err = run_cli(*args)
    assert code == 0, err
    runs = ["c-uniform-s0", "c-refinery-s0", "c-uniform-s1", "c-refinery-s1"]
    assert [ln.split()[1] for ln in out.splitlines() if ln.startswith("compare: c-") and "arm" in ln] == runs
    statuses = sql(store, "SELECT run_id, status, config FROM runs WHERE status = 'completed' ORDER BY run_id")
    assert sorted(statuses.column("run_id").to_pylist()) == sorted(runs)
    # every run drew the same pool and held out the same prompts
    pools = sql(store, "SELECT run_id, list(prompt_id ORDER BY prompt_id) AS ids FROM pool WHERE round = 0 AND "
                       "status = 'heldout' GROUP BY run_id").to_pylist()
    assert len(pools) == 4 and len({tuple(p["ids"]) for p in pools}) == 1 and pools[0]["ids"]
    # arms differ in what they ran; a new seed samples other completions of the same prompts
    assert sql(store, "SELECT DISTINCT selector FROM selections WHERE run_id LIKE 'c-uniform-%'"
               ).column("selector").to_pylist() == ["uniform"]
    done = {r["run_id"]: r["c"] for r in sql(store, "SELECT run_id, list(completion ORDER BY prompt_id, sample_idx) "
                                                    "AS c FROM rollouts GROUP BY run_id").to_pylist()}
    assert done["c-uniform-s0"] != done["c-uniform-s1"]
    lope = sql(store, "SELECT run_id, sum(tokens) AS t FROM generated_tokens WHERE purpose = 'lope' GROUP BY run_id")
    assert set(lope.column("run_id").to_pylist()) <= {"c-refinery-s0", "c-refinery-s1"}  # LoPE off in uniform
    # the summary: each arm's final held-out pass@1 with its interval, tokens, and the paired difference
    from flows.compare import final_matrix
    from tasks.core.stats import bootstrap_mean

    x, tokens = final_matrix(store, ["c-refinery-s0", "c-refinery-s1"])
    iv = bootstrap_mean(x)
    held = sql(store, "SELECT count(DISTINCT prompt_id) AS n FROM pool WHERE run_id = 'c-uniform-s0' AND "
                      "status = 'heldout'").to_pylist()[0]["n"]
    assert x.shape == (2, held) and all(t > 0 for t in tokens)
    summary = [ln for ln in out.splitlines() if ln.startswith(("compare: uniform:", "compare: refinery:"))]
    assert summary[1].startswith(f"compare: refinery: held-out pass@1 {iv.mean:.3f} [{iv.low:.3f}, {iv.high:.3f}] "
                                 f"over 2 seed(s) x {held} prompts") and "; vs uniform " in summary[1]
    assert "; vs" not in summary[0]
    # again: every run is complete, nothing is sampled again
    before = sql(store, "SELECT count(*) AS n FROM rollouts").to_pylist()
    code, out, err = run_cli(*args)
    assert code == 0, err
    assert sql(store, "SELECT count(*) AS n FROM rollouts").to_pylist() == before
    assert out.count("already complete") == 4
    # a bad arm is refused before any run starts
    code, _, err = run_cli("compare", "--arms", "uniform,nope", "--store", store.root)
    assert code == 1 and "unknown arm 'nope'" in err and err.count("\n") == 1


def test_the_default_arm_is_the_shipped_defaults_under_the_evidence_design():
    """`default` puts back the shipped value of every field benchmarks/evidence.toml pins outside the design
    itself (pool, evaluation, the model's arithmetic, budget, rounds): loaded over that config, it is
    RunConfig's defaults there."""
    import tomllib
    from pathlib import Path

    from flows.config import RunConfig, load_config

    design = Path(__file__).parent.parent / "benchmarks" / "evidence.toml"
    pinned = {f"{section}.{key}" for section, table in tomllib.loads(design.read_text()).items()
              if isinstance(table, dict) and section not in ("pool", "eval") for key in table
              if f"{section}.{key}" != "model.dtype"}  # the instrument's arithmetic, as pool and eval are
    assert pinned, "the evidence design pins nothing outside pool and eval: `default` would equal `refinery`"
    shipped, loaded = RunConfig(), load_config(str(design), sets=ARMS["default"])
    for field in sorted(pinned):
        section, key = field.split(".")
        assert getattr(getattr(loaded, section), key) == getattr(getattr(shipped, section), key), field
    assert {o.split("=")[0] for o in ARMS["default"]} == pinned  # and nothing else: the rest is the shared config


def test_every_arm_loads_over_the_evidence_design_and_a_candidate_is_the_default_plus_one_part():
    from pathlib import Path

    from flows.config import load_config

    design = str(Path(__file__).parent.parent / "benchmarks" / "evidence.toml")
    loaded = {name: load_config(design, sets=sets) for name, sets in ARMS.items()}
    assert loaded["default_thompson"].select.selector == "thompson" != loaded["default"].select.selector
    assert loaded["default_replay"].train.replay_share == 0.25 > loaded["default"].train.replay_share
    assert loaded["default_stratified"].rollout.screen_refill == "stratified" != loaded["default"].rollout.screen_refill
    for name in ("default_thompson", "default_replay", "default_stratified"):
        assert ARMS[name][: len(ARMS["default"])] == ARMS["default"] and len(ARMS[name]) == len(ARMS["default"]) + 1
    worked = loaded["default_worked"].shape  # one part in four fields: shaping on, and it generates nothing
    assert (worked.steps, worked.teacher_traces, worked.enabled) == (0, False, True)
    assert worked.max_traces > loaded["default"].shape.max_traces
    assert ARMS["default_worked"][: len(ARMS["default"])] == ARMS["default"]
    assert {o.split("=")[0] for o in ARMS["default_worked"][len(ARMS["default"]):]} == {
        "shape.enabled", "shape.steps", "shape.teacher_traces", "shape.max_traces"}
