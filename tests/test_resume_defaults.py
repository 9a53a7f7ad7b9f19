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
                            "teacher.concurrency": None})
    base, gone = stored_base(stored)
    assert gone == ["refine.gone_field"] and "concurrency" not in base["teacher"]
    config = load_config(sets=["rollout.temperature=0.9"], stored=stored, run_id="r")
    assert config.rollout.lope_prefixes == 6  # the stored value, not today's default (0)
    assert config.rounds == 5 and config.rollout.temperature == 0.9  # given: the user's value
    assert config.teacher.concurrency == RunConfig().teacher.concurrency  # added since: the default


def _before_the_teacher_section(**teacher) -> dict:
    """Today's defaults as a commit before the [teacher] section stored them: its fields were refine.teacher*."""
    tree = RunConfig().model_dump(mode="json")
    del tree["teacher"]
    tree["refine"].update({"teacher": "policy", "teacher_max_new_tokens": 128, "teacher_temperature": 0.7,
                           "teacher_timeout_s": 60.0, "teacher_retries": 3, "teacher_backoff_s": 1.0,
                           "teacher_concurrency": 4, **teacher})
    return tree


def test_a_run_stored_with_refine_teacher_fields_resumes_with_the_same_teacher():
    """A run started before the [teacher] section stored refine.teacher*: it resumes with those values, from the
    command line (stored base) and from the form (every field passed: keep_stored), with no change recorded;
    changing one that decides landed data is still refused, under its new name."""
    from flows.curriculum import check_resume, keep_stored

    stored = _before_the_teacher_section(teacher="openai:http://127.0.0.1:9#t", teacher_max_new_tokens=32,
                                         teacher_temperature=0.2, teacher_retries=5)
    want = {"model": "openai:http://127.0.0.1:9#t", "max_new_tokens": 32, "temperature": 0.2, "timeout_s": 60.0,
            "retries": 5, "backoff_s": 1.0, "concurrency": 4}
    base, gone = stored_base(stored)
    assert base["teacher"] == want and gone == [] and "teacher_retries" not in base["refine"]
    config = load_config(stored=stored, run_id="r")
    assert config.teacher.model_dump() == want and "teacher" not in config.refine.model_dump()
    assert check_resume(config, stored) is None
    form = keep_stored(RunConfig(run_id="r", teacher={"model": want["model"], "retries": 5}), stored)
    assert form.teacher.model_dump() == want  # the stored 32 and 0.2, not the form's defaults 128 and 0.7
    with pytest.raises(ValueError, match=r"differs in: teacher\.max_new_tokens\)"):
        check_resume(load_config(sets=["teacher.max_new_tokens=128"], stored=stored, run_id="r"), stored)
    assert check_resume(load_config(sets=["refine.teacher_retries=1"], stored=stored, run_id="r"), stored) == \
        "resumed with changed teacher.retries: 5 -> 1"  # an old key given on resume is read as its new one


def test_old_teacher_keys_in_a_config_file_read_as_the_new_ones(tmp_path):
    """A TOML written before the [teacher] section still loads (its refine.teacher* keys moved, silently), and a
    --set of the new key overrides it as any --set does; one file holding the old and the new key with
    different values is one error naming both."""
    old = tmp_path / "old.toml"
    old.write_text('[refine]\nteacher = "openai:http://127.0.0.1:9#t"\nteacher_temperature = 0.3\n'
                   'strategies = ["ladder"]\n')
    config = load_config(str(old))
    assert (config.teacher.model, config.teacher.temperature) == ("openai:http://127.0.0.1:9#t", 0.3)
    assert config.refine.strategies == ["ladder"]
    assert load_config(str(old), sets=["teacher.temperature=0.9"]).teacher.temperature == 0.9
    assert load_config(sets=["teacher.retries=7", "refine.teacher_retries=2"]).teacher.retries == 2  # the later
    both = tmp_path / "both.toml"
    both.write_text('[refine]\nteacher_temperature = 0.3\n[teacher]\ntemperature = 0.9\n')
    with pytest.raises(ValueError, match=r"^refine\.teacher_temperature \(0\.3\) and teacher\.temperature \(0\.9\) "
                       r"both given: refine\.teacher_temperature is now teacher\.temperature; give teacher\.temperature "
                       r"only$"):
        load_config(str(both))


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
    # stored before the [teacher] section: its refine.teacher* values carried over, not today's defaults
    moved = {new: old["refine"][f"teacher_{new}" if new != "model" else "teacher"]
             for new in ("model", "max_new_tokens", "temperature", "timeout_s", "retries", "backoff_s")}
    assert {k: ran["teacher"][k] for k in moved} == moved and "teacher" not in ran["refine"]


def test_a_run_started_while_shaping_was_on_by_default_resumes_shaping():
    """shape.enabled's default turned false (issue 50's pilots): a run stored with it true keeps shaping on a
    resume from the command line and from the form, and turning it off by hand is refused as a change."""
    from flows.curriculum import check_resume, keep_stored

    stored = _old_config(**{"shape.enabled": True})
    assert RunConfig().shape.enabled is False
    assert load_config(stored=stored, run_id="r").shape.enabled is True
    assert keep_stored(RunConfig(run_id="r"), stored).shape.enabled is True
    with pytest.raises(ValueError, match=r"differs in: shape\.enabled\)"):
        check_resume(RunConfig(run_id="r"), stored)
