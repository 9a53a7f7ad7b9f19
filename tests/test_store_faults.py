"""Store faults: corrupt or foreign files under `_landed/`, a copied store's catalog, and cleanup racing a
writer in another process."""

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time

import duckdb
import pytest
from conftest import ROOT, prompt_rows

from storage import query


@pytest.fixture
def landed(store):
    """A store with two good stages; the tests add one bad file each."""
    store.commit("ingest", {"prompts": prompt_rows(5)})
    store.commit("more", {"prompts": prompt_rows(3, offset=5)}, run_id="r", round=0)
    return store


def _record(store, run="r", round="0", stage="bad"):
    return store.path("_landed", f"run_id={run}", f"round={round}", f"{stage}.json")


def _good_record(store, stage="bad", **change):
    rec = {"run_id": "r", "round": 0, "stage": stage, "committed_at": "2026-01-01T00:00:00+00:00",
           "tables": {"prompts": {"paths": [f"prompts/run_id=r/round=0/stage={stage}/part-0.parquet"], "rows": 1}}}
    rec.update(change)
    return json.dumps(rec)


BAD = {  # kind: (file under the store, its content, a fragment of the one-line report)
    "junk written by COPY": (_record, "junk\n", "not valid JSON (Expecting value: line 1 column 1"),
    "empty file": (_record, "", "not valid JSON"),
    "a JSON list": (_record, "[1, 2]", "not a JSON object but list"),
    "a record missing keys": (_record, json.dumps({"run_id": "r", "round": 0}), "missing key(s) 'stage', 'tables'"),
    "wrong types": (_record, _good_record(None, round="0"), "wrong type"),
    "content that does not match its path": (_record, _good_record(None, stage="other"), "does not match its path"),
    "an unknown table": (_record, _good_record(None, tables={"nope": {"paths": [], "rows": 0}}), "unknown table 'nope'"),
    "a path outside its stage folder": (_record, _good_record(None, tables={"prompts": {
        "paths": [".prefect/prefect.db"], "rows": 1}}), "not a part file of this stage"),
    "a path escaping the store": (_record, _good_record(None, tables={"prompts": {
        "paths": ["prompts/run_id=r/round=0/stage=bad/../../../../../etc/passwd.parquet"], "rows": 1}}),
        "not a part file of this stage"),
    "files that do not exist": (_record, _good_record(None), "names 1 data file(s) that do not exist"),
    "a stray file": (lambda s: s.path("_landed", "README.txt"), "hello", "not a commit record"),
    "a stray file in a partition": (lambda s: s.path("_landed", "run_id=r", "round=0", "notes.md"), "x",
                                    "not a commit record"),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_a_bad_landed_file_is_reported_by_path_and_the_rest_reads(landed, kind, caplog):
    where, content, problem = BAD[kind]
    path = where(landed)
    landed.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    landed._write_text(path, content)
    with caplog.at_level(logging.WARNING, logger="refinery.store"):
        assert len(landed.records()) == 2
        assert query.sql(landed, "SELECT count(*) AS n FROM prompts").to_pylist() == [{"n": 8}]
        assert query.scan(landed, "prompts").collect().height == 8
        assert query.connect(landed).execute("SELECT count(*) FROM prompts").fetchone() == (8,)
    [line] = landed.problems()
    assert line.startswith(f"{path}: ") and problem in line and "\n" not in line
    warnings = [r.getMessage() for r in caplog.records if path in r.getMessage()]
    assert len(warnings) == 1 and problem in warnings[0]  # once per process, not once per read


def test_a_corrupt_record_counts_as_not_landed_and_the_rerun_replaces_it(landed):
    rec = _record(landed, stage="more")
    data = landed.path("prompts", "run_id=r", "round=0", "stage=more")
    landed._write_text(rec, "junk\n")
    assert not landed.landed("r", 0, "more")  # readers do not see it, so resume must not skip it
    assert query.sql(landed, "SELECT count(*) AS n FROM prompts").to_pylist() == [{"n": 5}]
    # cleanup keeps the data of an invalid record (it may be all that is left of an ingest)...
    assert landed.cleanup() == [] and landed.fs.exists(data)
    # ...and the stage's re-run lands and replaces record and folder
    again = landed.commit("more", {"prompts": prompt_rows(3, offset=5)}, run_id="r", round=0)
    assert again.landed_now and landed.landed("r", 0, "more") and landed.problems() == []
    assert query.sql(landed, "SELECT count(*) AS n FROM prompts").to_pylist() == [{"n": 8}]


def test_a_record_whose_data_was_deleted_is_not_landed(landed):
    shutil.rmtree(landed.path("prompts", "run_id=r", "round=0", "stage=more"))
    assert not landed.landed("r", 0, "more")
    assert query.sql(landed, "SELECT count(*) AS n FROM prompts").to_pylist() == [{"n": 5}]
    assert "do not exist" in landed.problems()[0]


def test_a_copied_store_catalog_opens_and_queries(landed, tmp_path, monkeypatch):
    query.write_catalog(landed)
    copy = tmp_path / "elsewhere" / "copied-store"
    shutil.copytree(landed.root, copy)
    shutil.rmtree(landed.root)  # the original is gone: nothing may point at it
    monkeypatch.chdir(copy)  # the rule: open the catalog from inside the store
    con = duckdb.connect(str(copy / "catalog.duckdb"), read_only=True)
    assert con.execute("SELECT count(*), count(DISTINCT prompt_id) FROM prompts").fetchone() == (8, 8)
    assert con.execute("SELECT count(*) FROM rollouts").fetchone() == (0,)
    con.close()
    monkeypatch.chdir(tmp_path)  # or from anywhere, with the store as the file search path
    con = duckdb.connect(str(copy / "catalog.duckdb"), read_only=True)
    con.execute(f"SET file_search_path = '{copy}'")
    assert con.execute("SELECT count(*) FROM prompts").fetchone() == (8,)
    con.close()


WRITER = """
import sys
sys.path.insert(0, "tests")
from conftest import prompt_rows
from storage.store import Store
store = Store(sys.argv[1])
for i in range(int(sys.argv[2])):
    store.commit(f"s{i}", {"prompts": prompt_rows(3, offset=3 * i)}, run_id="w", round=0)
"""


def _popen(store, n, env):
    """The writer in a fresh interpreter (a real second process), committing n stages."""
    return subprocess.Popen([sys.executable, "-c", WRITER, store.root, str(n)], cwd=ROOT,
                            env={**os.environ, **(env or {})}, stderr=subprocess.PIPE, text=True)


def test_cleanup_never_sees_a_writers_temp_folder_without_its_owner(store, tmp_path):
    """The writer in another process stops right after creating its temp folder, before its owner record
    (the window where cleanup used to delete it): cleanup waits for the claim to finish, keeps the folder,
    and the writer lands."""
    flag, release = tmp_path / "reached", tmp_path / "release"
    proc = _popen(store, 1, {"REFINERY_FAULT": "commit:tmp-created", "REFINERY_FAULT_FLAG": str(flag),
                             "REFINERY_FAULT_RELEASE": str(release)})
    try:
        deadline = time.time() + 60
        while not flag.exists():
            assert proc.poll() is None, proc.stderr.read()
            assert time.time() < deadline, "the writer never reached its temp folder"
            time.sleep(0.02)
        [tmp] = store.fs.glob(store.path(".tmp", "*"))
        assert not store.fs.exists(tmp + "/owner.json")  # inside the window
        removed = []
        cleaner = threading.Thread(target=lambda: removed.extend(store.cleanup()))
        cleaner.start()
        cleaner.join(0.5)
        assert cleaner.is_alive() and store.fs.exists(tmp)  # cleanup waits on the claim
        release.write_text("go")
        cleaner.join(60)
        assert not cleaner.is_alive() and tmp not in removed
        assert proc.wait(60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert store.landed("w", 0, "s0") and query.scan(store, "prompts").collect().height == 3


def test_cleanup_in_a_loop_never_breaks_a_concurrent_writer(store):
    n = 8
    proc = _popen(store, n, None)
    removed = []
    try:
        while proc.poll() is None:
            removed += store.cleanup()
        assert proc.returncode == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert removed == []
    assert all(store.landed("w", 0, f"s{i}") for i in range(n))
    assert query.sql(store, "SELECT count(*) AS n FROM prompts").to_pylist() == [{"n": 3 * n}]


def test_a_record_that_is_not_utf8_is_reported_not_raised(landed):
    path = _record(landed, stage="more")
    with open(path, "wb") as f:
        f.write(b"\xff\xfe\x00junk")
    assert not landed.landed("r", 0, "more")
    assert len(landed.records()) == 1 and "unreadable" in landed.problems()[0]


def test_a_failed_catalog_build_leaves_no_temp_file(landed, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("view building broke")

    monkeypatch.setattr(query, "connect", broken)
    with pytest.raises(RuntimeError, match="view building broke"):
        query.write_catalog(landed)
    assert not [p for p in os.listdir(landed.root) if p.startswith(".catalog-")]
    assert not os.path.exists(landed.path("catalog.duckdb"))
