"""Every run records the commit of its code and whether that code had uncommitted changes
(storage/provenance.py); a comparison refuses to mix commits or uncommitted code unless told to
(`--allow-mixed`), and then says so first (flows/compare.py `mixed_code`, benchmarks/evidence.py)."""

import subprocess

import pytest
from conftest import ROOT, run_cli

from flows.compare import code_of_runs, mixed_code
from storage.provenance import code_version
from storage.query import sql
from storage.runs import mark


def test_a_run_row_records_the_checkout_s_commit_and_whether_its_code_changed(store, monkeypatch):
    monkeypatch.delenv("REFINERY_CODE_VERSION")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    changed = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "flows", "tasks", "storage",
                              "models", "pyproject.toml", "requirements", "constraints-cpu.txt"],
                             capture_output=True, text=True).stdout.strip() != ""
    assert code_version() == (head, changed)
    mark(store, "r", "running", {})
    assert sql(store, "SELECT commit, dirty FROM runs").to_pylist() == [{"commit": head, "dirty": changed}]


def _runs(store, monkeypatch, made: dict[str, tuple[str, bool]], config: dict | None = None):
    """Runs whose rows record the given commits (and dirtiness)."""
    for run_id, (commit, dirty) in made.items():
        monkeypatch.setattr("storage.runs.code_version", lambda c=commit, d=dirty: (c, d))
        mark(store, run_id, "running", config or {})
        mark(store, run_id, "completed", config or {})
    monkeypatch.undo()


def test_runs_of_two_commits_or_with_uncommitted_code_are_refused_unless_allowed(store, monkeypatch):
    _runs(store, monkeypatch, {"a-s0": ("c0ffee", False), "a-s1": ("c0ffee", False)})
    assert code_of_runs(store, ["a-s0", "a-s1"]) == (["c0ffee"], [])
    assert mixed_code(store, ["a-s0", "a-s1"], False, False) is None
    monkeypatch.setenv("REFINERY_CODE_VERSION", "beef00")
    assert mixed_code(store, ["a-s0", "a-s1"], False, False) is None  # nothing runs now: one commit
    with pytest.raises(ValueError, match=r"its runs come from 2 commits \(beef00, c0ffee\)"):
        mixed_code(store, ["a-s0", "a-s1"], True, False)
    _runs(store, monkeypatch, {"b-s0": ("c0ffee", True)})
    line = mixed_code(store, ["a-s0", "b-s0"], False, True)
    assert line == "mixed code: 1 run(s) were made with uncommitted changes (b-s0)"
    store.commit("running-9", {"runs": __import__("pyarrow").table({  # a row from before commits were recorded
        "run_id": ["old"], "created_at": [__import__("datetime").datetime(2026, 1, 1)], "status": ["running"],
        "config": ["{}"]})}, run_id="old")
    assert "their code is unknown" in mixed_code(store, ["a-s0", "old"], False, True)


def test_compare_refuses_runs_of_another_commit_in_one_line_before_any_run(prefect_api, store, monkeypatch):
    from test_eval_dataset import SETS

    from flows.compare import plan
    from flows.config import load_config

    sets = [x for s in SETS for x in ("--set", s)]
    planned = plan(["uniform"], 1, "cmp", SETS, {})[0]  # as compare would run it: seed 0 is complete, seed 1 not
    config = load_config(sets=planned.sets, run_id=planned.run_id, store=store.root, rounds=1).model_dump(mode="json")
    _runs(store, monkeypatch, {"cmp-uniform-s0": ("c0ffee", False)}, config)
    monkeypatch.setenv("REFINERY_CODE_VERSION", "beef00")
    code, out, err = run_cli("compare", "--arms", "uniform", "--seeds", "2", "--rounds", "1", "--store", store.root,
                             *sets)
    assert code == 1 and err.splitlines()[0] == (
        "refinery: error: mixed code: its runs come from 2 commits (beef00, c0ffee): a comparison describes one "
        "commit; commit (or stash) the changes, finish it at one commit or use another --prefix, or pass "
        "--allow-mixed") and len(err.splitlines()) == 1
    assert sql(store, "SELECT count(*) AS n FROM rollouts").to_pylist() == [{"n": 0}]


def test_runs_written_before_commits_were_recorded_count_as_unrecorded():
    """The golden `resume` store was written by a7d6317, before `runs.commit` existed: its runs read as
    `unrecorded`, not as a missing column (the committed evidence store is such a store)."""
    from pathlib import Path

    from storage.store import Store

    store = Store(Path(__file__).parent / "data" / "golden" / "resume")
    assert code_of_runs(store, ["resume"]) == (["unrecorded"], [])
