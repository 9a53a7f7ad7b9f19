"""A resume takes the run's stored config and compares only what the user gives against it, so a default that
changed since the run started never blocks its resume (flows/config.py `load_config(stored=...)`,
flows/curriculum.py `check_resume`, `keep_stored`)."""

import json
import shutil

import pytest
from conftest import ROOT, run_cli
from golden import RUNS

from flows.config import RunConfig, load_config, stored_base
from storage.runs import mark, run_rows, stored_config
from storage.store import Store

GOLDEN = ROOT / "tests" / "data" / "golden"


def _old_config(**changes) -> dict:
    """Today's defaults with `changes` (dotted path -> value, None removes the field), as an older commit
    stored them."""
    tree = RunConfig().model_dump(mode="json")
    for path, value in changes.items():
        *sections, leaf = path.split(".")
        node = tree
        for name in sections:
            node = node.setdefault(name, {})
        if value is None:
            del node[leaf]
        else:
            node[leaf] = value
    return tree


def test_what_the_user_does_not_give_keeps_the_stored_value():
    stored = _old_config(**{"rollout.lope_prefixes": 6, "rounds": 5, "refine.gone_field": 1,
                            "refine.teacher_concurrency": None})
    base, gone = stored_base(stored)
    assert gone == ["refine.gone_field"] and "teacher_concurrency" not in base["refine"]
    config = load_config(sets=["rollout.temperature=0.9"], stored=stored, run_id="r")
    assert config.rollout.lope_prefixes == 6  # the stored value, not today's default (0)
    assert config.rounds == 5 and config.rollout.temperature == 0.9  # given: the user's value
    assert config.refine.teacher_concurrency == RunConfig().refine.teacher_concurrency  # added since: the default


def test_a_changed_default_is_no_change_but_a_given_value_is():
    from flows.curriculum import check_resume

    stored = _old_config(**{"rollout.lope_prefixes": 6, "refine.gone_field": 1})
    assert check_resume(load_config(stored=stored, run_id="r"), stored) == \
        "resumed without refine.gone_field (no longer a config field)"
    with pytest.raises(ValueError, match=r"differs in: rollout\.lope_prefixes\)"):
        check_resume(load_config(sets=["rollout.lope_prefixes=0"], stored=stored, run_id="r"), stored)
    note = check_resume(load_config(stored=stored, run_id="r", rounds=4), stored)
    assert note.startswith("resumed with changed rounds: 2 -> 4, and without refine.gone_field")


def test_a_form_that_passes_every_default_keeps_the_stored_values():
    """The UI form and a deployment pass every field: one left at today's default where the run stored another
    value that decides landed data takes the stored value; a value that is not the default is the user's."""
    from flows.curriculum import check_resume, keep_stored

    stored = _old_config(**{"rollout.lope_prefixes": 6, "model.batch_size": 8})
    form = RunConfig(run_id="r")
    kept = keep_stored(form, stored)
    assert kept.rollout.lope_prefixes == 6
    assert kept.model.batch_size == RunConfig().model.batch_size  # may change on resume: the form's value
    assert check_resume(kept, stored) == f"resumed with changed model.batch_size: 8 -> {RunConfig().model.batch_size}"
    other = RunConfig(run_id="r", rollout={"lope_prefixes": 2})
    with pytest.raises(ValueError, match=r"differs in: rollout\.lope_prefixes\)"):
        check_resume(keep_stored(other, stored), stored)


def test_an_old_store_whose_run_has_other_defaults_resumes_from_the_command_line(prefect_api, tmp_path, monkeypatch):
    """The golden store written by an older commit (tests/data/golden/) under settings that are no longer the
    defaults, with a field since removed and one added since: `refinery run --run-id resume --rounds 3` goes
    on with the stored values, no `--set` needed; a given value that differs is refused in one line."""
    monkeypatch.chdir(ROOT)  # the stored config names its source file relative to the repository
    shutil.copytree(GOLDEN / "resume", tmp_path / "store")
    store = Store(tmp_path / "store")
    old = stored_config(store, "resume")
    assert old["rollout"]["lope_prefixes"] != RunConfig().rollout.lope_prefixes  # the case at hand
    doctored = json.loads(json.dumps(old))
    doctored["refine"]["gone_field"] = 1
    del doctored["refine"]["teacher_concurrency"]
    mark(store, "resume", "completed", doctored)
    code, _, err = run_cli("run", "--run-id", "resume", "--rounds", str(RUNS["resume"]["rounds"] + 1),
                           "--store", store.root, "--set", "rollout.lope_prefixes=0")
    assert code == 1 and "differs in: rollout.lope_prefixes)" in err
    code, out, err = run_cli("run", "--run-id", "resume", "--rounds", str(RUNS["resume"]["rounds"] + 1),
                             "--store", store.root)
    assert code == 0, err
    assert "round 2: collect done" in out
    rows = run_rows(store, "resume")
    assert rows["status"].to_list()[-2:] == ["resumed", "completed"]
    assert rows["reason"][-2] == ("resumed with changed rounds: 2 -> 3, and without refine.gone_field (no longer "
                                  "a config field)")
    ran = json.loads(rows["config"][-1])
    assert ran["rollout"]["lope_prefixes"] == old["rollout"]["lope_prefixes"]
    assert ran["model"]["backend"] == "scripted"  # the stored policy, not today's default model
