"""An import knows its dump (issue 47, items 1-3 and 8): a run's dump is its content, digested, not its path;
imports under one run id take the run lock; everything that can fail is checked before anything lands, so a
refused import leaves the store byte-identical (or absent); rewards and --correct-at must be finite numbers.

The cases whose point is what the user sees run the real `refinery` entry point as a subprocess.
"""

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import run_cli
from test_cli_errors import REFINERY, assert_one_line_error, refinery

from storage.query import sql
from storage.runs import mark, stored_config
from storage.store import Store
from tasks.core.dump_digest import dump_digest

TOK = ["--tokenizer", "tiny-random"]


@pytest.fixture(autouse=True)
def _own_prefect_home(monkeypatch):
    """Each command's Prefect home is its store's `.prefect`, not one an earlier in-process command or the
    session's API fixture left in os.environ, so a test of what a command makes in the store sees it."""
    monkeypatch.delenv("PREFECT_HOME", raising=False)


def store_digest(path: Path) -> str | None:
    """sha256 over every file under `path` (relative path and bytes, nothing ignored); None if it is absent."""
    if not path.exists():
        return None
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*")):
        rel = f.relative_to(path).as_posix()
        h.update(f"{rel}\0{'d' if f.is_dir() else f.stat().st_size}\0".encode())
        if f.is_file():
            h.update(f.read_bytes())
    return h.hexdigest()


def write_plain(path: Path, questions, rewards=(1.0, 0.0)) -> Path:
    path.write_text("".join(json.dumps({"prompt": q, "completion": f"c{i}", "reward": r}) + "\n"
                            for q in questions for i, r in enumerate(rewards)))
    return path


def imported(root: Path, run_id: str) -> set[str]:
    return {r["prompt_text"] for r in sql(Store(root), f"SELECT DISTINCT prompt_text FROM rollouts "
                                                      f"WHERE run_id = '{run_id}'").to_pylist()}


def test_two_different_dumps_started_together_land_one(tmp_path):
    a = write_plain(tmp_path / "a.jsonl", ["a1", "a2"])
    b = write_plain(tmp_path / "b.jsonl", ["b1", "b2", "b3"])
    root = tmp_path / "store"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REFINERY_", "PREFECT_"))} | {"HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen([str(REFINERY), "import", "plain", str(d), "--run-id", "r", "--store", str(root), *TOK],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for d in (a, b)]
    done = [(p, *p.communicate(timeout=300)) for p in procs]
    codes = sorted(p.returncode for p, _, _ in done)
    assert codes == [0, 1], [(p.returncode, err) for p, _, err in done]
    (winner, _, _), (_, _, loser_err) = sorted(done, key=lambda x: x[0].returncode)
    assert_one_line_error(subprocess.CompletedProcess([], 1, "", loser_err), "run r")
    dump = a if winner is procs[0] else b
    texts = {json.loads(line)["prompt"] for line in dump.read_text().splitlines()}
    assert imported(root, "r") == texts
    assert {r["text"] for r in sql(Store(root), "SELECT text FROM prompts").to_pylist()} == texts  # nothing of the loser
    assert stored_config(Store(root), "r")["imported"]["digest"] == dump_digest("plain", str(dump))


def test_a_different_or_edited_dump_or_a_bad_tokenizer_is_refused_and_writes_nothing(tmp_path):
    a = write_plain(tmp_path / "a.jsonl", ["a1", "a2"])
    root = tmp_path / "store"
    assert refinery("import", "plain", str(a), "--run-id", "r", "--store", str(root), *TOK, cwd=tmp_path).returncode == 0
    before = store_digest(root)
    b = write_plain(tmp_path / "b.jsonl", ["b1"])
    p = refinery("import", "plain", str(b), "--run-id", "r", "--store", str(root), *TOK, cwd=tmp_path)
    assert_one_line_error(p, "run r already exists", "different dump", str(a))
    # checked before the run id, the prompts or a lock: a new run id changes nothing either
    p = refinery("import", "plain", str(b), "--run-id", "s", "--store", str(root), "--tokenizer", "/etc",
                 cwd=tmp_path)
    assert_one_line_error(p, "--tokenizer /etc")
    write_plain(a, ["a1", "a2", "a3"])  # edited in place: the same path is no longer the same dump
    p = refinery("import", "plain", str(a), "--run-id", "r", "--store", str(root), *TOK, cwd=tmp_path)
    assert_one_line_error(p, "run r already exists", "different dump")
    assert store_digest(root) == before
    assert imported(root, "r") == {"a1", "a2"}


def test_the_same_dump_under_another_path_is_the_same_import(tmp_path):
    (tmp_path / "sub").mkdir()
    a = write_plain(tmp_path / "sub" / "a.jsonl", ["a1", "a2"])
    root = tmp_path / "store"
    assert refinery("import", "plain", str(a), "--run-id", "r", "--store", str(root), *TOK, cwd=tmp_path).returncode == 0
    before = store_digest(root)
    copy = shutil.copy(a, tmp_path / "renamed copy.jsonl")
    for path in ("./sub/a.jsonl", str(copy)):
        p = refinery("import", "plain", path, "--run-id", "r", "--store", str(root), *TOK, cwd=tmp_path)
        assert p.returncode == 0 and "0 round(s) landed now" in p.stdout, (path, p.stderr)
    assert store_digest(root) == before  # a no-op: not even a `runs` row


def test_a_folder_dump_is_its_files_relative_paths_and_bytes(tmp_path):
    for d in ("x", "y"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "1.jsonl").write_text('{"input": "q", "output": "o", "score": 1.0, "step": 1}\n')
    (tmp_path / "y" / "notes.txt").write_text("not read by the verl reader")
    assert dump_digest("verl", str(tmp_path / "x")) == dump_digest("verl", str(tmp_path / "y"))
    (tmp_path / "y" / "1.jsonl").rename(tmp_path / "y" / "2.jsonl")  # same bytes, another step's file
    assert dump_digest("verl", str(tmp_path / "x")) != dump_digest("verl", str(tmp_path / "y"))


def test_a_run_imported_before_digests_is_matched_by_its_path(store, tmp_path):
    a = write_plain(tmp_path / "a.jsonl", ["a1"])
    code, _, err = run_cli("import", "plain", str(a), "--run-id", "old", "--store", store.root, *TOK)
    assert code == 0, err
    code, _, err = run_cli("import", "plain", str(a), "--run-id", "old", "--store", store.root, "--correct-at", "0.5",
                           *TOK)
    assert code == 1 and "imported from this dump with other settings (differs in: correct_at)" in err, err
    legacy = stored_config(store, "old")
    legacy["imported"] = {k: v for k, v in legacy["imported"].items() if k != "digest"}
    mark(store, "old", "failed", legacy)  # as an older Refinery recorded it; failed: the rerun has work to do
    code, out, err = run_cli("import", "plain", str(a), "--run-id", "old", "--store", store.root, *TOK)
    assert code == 0 and "0 round(s) landed now" in out, err
    assert "digest" in stored_config(store, "old")["imported"]  # recorded from now on
    mark(store, "old", "failed", legacy)
    code, _, err = run_cli("import", "plain", str(shutil.copy(a, tmp_path / "b.jsonl")), "--run-id", "old",
                           "--store", store.root, *TOK)
    assert code == 1 and "run old already exists" in err, err


BAD = {"bad rows": ['{"prompt": "q", "completion": "c", "reward": "high"}'],
       "no rollouts": ['{"prompt": "q", "completion": "c", "reward": null}'],
       "infinite": ['{"prompt": "q", "completion": "c", "reward": Infinity}']}


@pytest.mark.parametrize("case, lines, args, needle", [
    ("bad rows", BAD["bad rows"], [], "line 1: reward 'high' is not a finite number"),
    ("no rollouts", BAD["no rollouts"], ["--skip-invalid"], "no rollouts to import"),
    ("non-finite reward", BAD["infinite"], [], "line 1: reward inf is not a finite number"),
    ("correct-at nan", None, ["--correct-at", "nan"], "--correct-at nan: not a finite number"),
    ("correct-at inf", None, ["--correct-at", "inf"], "--correct-at inf: not a finite number"),
    ("reward column", None, ["--reward-column", "x"], "--reward-column x: only a trl dump"),
    ("tokenizer", None, ["--tokenizer", "/etc"], "--tokenizer /etc"),
])
def test_a_refused_import_makes_no_store(tmp_path, case, lines, args, needle):
    dump = tmp_path / "d.jsonl"
    if lines is None:
        write_plain(dump, ["q"])
    else:
        dump.write_text("\n".join(lines) + "\n")
    p = refinery("import", "plain", str(dump), "--run-id", "r", "--store", str(tmp_path / "S"),
                 *(args if "--tokenizer" in args else [*TOK, *args]), cwd=tmp_path)
    assert_one_line_error(p, needle)
    assert not (tmp_path / "S").exists() and not (tmp_path / ".prefect").exists()


def test_rewards_must_be_finite_and_in_range(store, tmp_path):
    rewards = ["1.0", "Infinity", "-Infinity", "NaN", "1e999", "1e308", "-1e308", "0.0"]
    dump = tmp_path / "r.jsonl"
    dump.write_text("".join(f'{{"prompt": "q", "completion": "c{i}", "reward": {r}}}\n' for i, r in enumerate(rewards)))
    p = refinery("import", "plain", str(dump), "--run-id", "r", "--store", store.root, *TOK, cwd=tmp_path)
    problems = [(2, "reward inf is not a finite number"), (3, "reward -inf is not a finite number"),
                (4, "reward nan is not a finite number"), (5, "reward inf is not a finite number"),
                (6, "reward 1e+308 is beyond ±1e+15"), (7, "reward -1e+308 is beyond ±1e+15")]
    line = assert_one_line_error(p, "r.jsonl: rejected, 6 bad row(s), nothing written")
    for n, problem in problems[:5]:  # the one line keeps the first five (flows/cli/errors.py MAX_PARTS)
        assert f"r.jsonl line {n}: {problem}" in line
    assert not Path(store.root).exists()
    code, out, err = run_cli("import", "plain", str(dump), "--run-id", "r", "--store", store.root, "--skip-invalid",
                             *TOK)
    assert code == 0 and "2 rollouts" in out and err.count("skipped ") == 6, err
    for n, problem in problems:
        assert f"r.jsonl line {n}: {problem}" in err
    assert sql(store, "SELECT completion, reward FROM rollouts ORDER BY completion").to_pylist() == [
        {"completion": "c0", "reward": 1.0}, {"completion": "c7", "reward": 0.0}]
    std = sql(store, "SELECT std_reward FROM prompt_scores").to_pylist()
    assert std == [{"std_reward": 0.5}]


def test_a_trl_reward_column_that_is_not_finite_is_named(store, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "trl").mkdir()
    pq.write_table(pa.table({"step": pa.array([1, 1], pa.int64()), "prompt": ["q", "q"], "completion": ["a", "b"],
                             "r1": [1.0, float("inf")], "r2": [0.0, 0.0]}),
                   tmp_path / "trl" / "completions_00001.parquet")
    code, _, err = run_cli("import", "trl", str(tmp_path / "trl"), "--run-id", "t", "--store", store.root, *TOK)
    assert code == 1 and "completions_00001.parquet line 2: reward inf is not a finite number" in err, err
