import pytest

from flows.config import RunConfig, load_config


def test_defaults_are_the_embedded_demo():
    c = RunConfig()
    assert (c.model.policy, c.rollout.group_size, c.rollout.temperature, c.rounds) == ("default", 8, 0.7, 2)
    assert {s.source for s in c.pool.sources} == {"rg:products", "rg:basic_arithmetic", "rg:chain_sum"}


@pytest.mark.parametrize("sets,field", [
    (["rollout.group_size=1"], "rollout.group_size"),
    (["rounds=-1"], "rounds"),
    (["rollout.temperature=-0.1"], "rollout.temperature"),
    (["model.policy=./no/such/model"], "model.policy"),
    (["reward.verifier=magic"], "reward.verifier"),
    (["utility.beta=0"], "utility.beta"),
    (["rollout.colour=blue"], "rollout.colour"),
    (['pool.sources=[{"source": "rg:products", "size": 0}]'], "pool.sources.0.size"),
    (["eval.heldout_fraction=1.0"], "eval.heldout_fraction"),
    (["eval.heldout_fraction=0"], "eval.heldout_fraction"),
    (["train.mode=qlora"], "train.mode"),
    (["train.lr=-1e-5"], "train.lr"),
    (["shape.variant=gibbs"], "shape.variant"),
    (['refine.strategies=["ladder", "magic"]'], "refine.strategies.1"),
    (["rollout.lope_samples=-4"], "rollout.lope_samples"),
    (["select.selector=magic"], "select.selector"),
    (["select.batch_size=-3"], "select.batch_size"),
])
def test_invalid_config_names_the_field(sets, field):
    with pytest.raises(ValueError, match=f"invalid config: {field.replace('.', '[.]')}"):
        load_config(sets=sets)


def test_toml_file_and_overrides(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('rounds = 3\n[rollout]\ngroup_size = 4\n[model]\npolicy = "tiny-random"\n')
    c = load_config(str(f), ["rollout.temperature=1.0"], run_id="x")
    assert (c.rounds, c.rollout.group_size, c.rollout.temperature, c.model.policy, c.run_id) == (3, 4, 1.0, "tiny-random", "x")
    with pytest.raises(ValueError, match="does not exist"):
        load_config(str(tmp_path / "missing.toml"))
    (tmp_path / "bad.toml").write_text("rounds = [")
    with pytest.raises(ValueError, match="bad.toml"):
        load_config(str(tmp_path / "bad.toml"))


def test_schema_carries_bounds_for_the_ui_form():
    schema = RunConfig.model_json_schema()
    rollout = schema["$defs"]["RolloutConfig"]["properties"]
    assert rollout["group_size"]["minimum"] == 2 and rollout["temperature"]["maximum"] == 2.0
    assert schema["$defs"]["RewardConfig"]["properties"]["verifier"]["enum"] == ["auto", "rg", "math", "exact"]


def test_readme_example_config_is_accepted(tmp_path):
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    example = re.search(r"```toml\n(.*?)```", readme, re.DOTALL).group(1)
    (tmp_path / "example.toml").write_text(example)
    c = load_config(str(tmp_path / "example.toml"))
    defaults = RunConfig()
    for section in ("model", "rollout", "select", "refine", "reward", "utility"):
        assert getattr(c, section) == getattr(defaults, section), section
    assert c.run_id == "my-run" and len(c.pool.sources) == 2


def test_cross_field_rule_is_named_too():
    with pytest.raises(ValueError, match=r"eval\.k \(8\) must be <= eval\.n_samples \(4\)"):
        load_config(sets=["eval.k=8"])


def test_refinery_run_rejects_a_bad_config_before_any_work(tmp_path, capsys):
    from flows.cli import main

    store = tmp_path / "store"
    assert main(["run", "--store", str(store), "--set", "rollout.group_size=1", "--set", "select.selector=magic"]) == 1
    err = capsys.readouterr().err
    assert "rollout.group_size: Input should be greater than or equal to 2" in err and "select.selector" in err
    assert not store.exists()  # nothing was started: no store, no Prefect home
