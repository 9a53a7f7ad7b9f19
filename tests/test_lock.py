"""The locked install (requirements/lock.py): the locks match pyproject.toml's dependencies, and this
environment holds exactly the locked versions (`make venv` installs the locks with their hashes and prunes
the rest), so what CI tests is what a fresh clone installs."""

import importlib.util
import shutil
import sys

from conftest import ROOT

spec = importlib.util.spec_from_file_location("lock", ROOT / "requirements" / "lock.py")
lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)


def test_the_locks_match_their_inputs():
    assert lock.stale(ROOT) == []


def test_a_changed_dependency_makes_the_locks_stale_but_a_changed_tool_setting_does_not(tmp_path):
    for name in ("pyproject.toml", "constraints-cpu.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "requirements", tmp_path / "requirements")
    pyproject = tmp_path / "pyproject.toml"
    text = pyproject.read_text()
    pyproject.write_text(text.replace("line-length = 120", "line-length = 100"))
    assert lock.stale(tmp_path) == []
    pyproject.write_text(text.replace('"duckdb>=1.2"', '"duckdb>=1.3"'))
    problems = lock.stale(tmp_path)
    assert len(problems) == 2 and all("is stale" in p and "make lock" in p for p in problems)
    (tmp_path / "requirements" / "models.txt").unlink()
    assert "requirements/models.txt is missing: run `make lock`" in lock.stale(tmp_path)


def test_this_environment_holds_exactly_the_locked_versions():
    extra, wrong = lock.differences(lock.installed(sys.executable), lock.locked())
    assert (extra, wrong) == ([], []), "run `make venv` (it installs the locks and removes the rest)"
    assert lock.locked()["torch"].endswith("+cpu") and "prefect" in lock.locked()


def test_differences_name_extra_and_wrong_versions():
    have = {"prefect": "3.9.1", "duckdb": "2.0.0", "stray": "1.0", "pip": "24", "curriculum-refinery": "0.1.0"}
    want = {"prefect": "3.9.1", "duckdb": "2.0.1", "polars": "2.1.0"}
    assert lock.differences(have, want) == (["stray==1.0"], ["duckdb==2.0.1 (installed: 2.0.0)",
                                                             "polars==2.1.0 (installed: none)"])
