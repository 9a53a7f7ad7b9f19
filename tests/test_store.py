import json
import os

import duckdb
import pyarrow as pa
import pytest
from conftest import prompt_rows, q

from storage import query
from storage.lineage import lineage
from storage.schemas import TABLES, conform
from storage.store import Store


def test_commit_lands_once_and_says_so(store):
    first = store.commit("s1", {"prompts": prompt_rows(5)}, run_id="r1", round=0)
    assert first.landed_now and first.rows == {"prompts": 5}
    assert store.landed("r1", 0, "s1") and not store.landed("r1", 1, "s1") and not store.landed("r1", 0, "s2")
    again = store.commit("s1", {"prompts": prompt_rows(7)}, run_id="r1", round=0)
    assert not again.landed_now and "already landed" in again.message
    assert query.scan(store, "prompts").collect().height == 5


def test_stage_is_hive_partitioned_by_run_and_round(store):
    store.commit("collect", {"prompts": prompt_rows(2), "pool": pa.table(
        {"run_id": ["r"], "round": [3], "prompt_id": ["x"], "status": ["active"]})}, run_id="r", round=3)
    files = store.files("pool")
    assert len(files) == 1 and "/pool/run_id=r/round=3/stage=collect/" in files[0]
    rec = store.records()[0]
    assert set(rec["tables"]) == {"prompts", "pool"} and rec["tables"]["pool"]["rows"] == 1


def test_every_table_has_a_view_even_when_empty(store):
    con = query.connect(store)
    for name, sch in TABLES.items():
        rel = con.sql(f"SELECT * FROM {name}")
        assert rel.columns == sch.names
        assert rel.fetchall() == []


def test_conform_names_bad_columns():
    with pytest.raises(ValueError, match="'answer'"):
        conform("prompts", prompt_rows(1).drop(["answer"]))
    bad = prompt_rows(1).set_column(0, "prompt_id", pa.array([None], pa.string()))
    with pytest.raises(ValueError, match="'prompt_id' has 1 null"):
        conform("prompts", bad)
    with pytest.raises(KeyError, match="unknown table 'nope'"):
        conform("nope", prompt_rows(1))


def test_bad_names_are_refused(store):
    with pytest.raises(ValueError, match="stage '../x'"):
        store.commit("../x", {"prompts": prompt_rows(1)})
    with pytest.raises(ValueError, match="run_id 'a/b'"):
        store.commit("s", {"prompts": prompt_rows(1)}, run_id="a/b", round=0)


def test_polars_and_duckdb_agree(store):
    store.commit("a", {"prompts": prompt_rows(10)})
    store.commit("b", {"prompts": prompt_rows(10, offset=10)})
    lf = query.scan(store, "prompts")
    assert lf.collect().height == 20
    assert query.connect(store).execute("SELECT count(DISTINCT prompt_id) FROM prompts").fetchone()[0] == 20


def test_catalog_opens_in_a_plain_duckdb_client(store, monkeypatch):
    store.commit("a", {"prompts": prompt_rows(4)})
    path = query.write_catalog(store)
    monkeypatch.chdir(store.root)  # the catalog names its files relative to the store folder
    con = duckdb.connect(path, read_only=True)
    assert con.execute("SELECT count(*) FROM prompts").fetchone()[0] == 4
    assert con.execute("SELECT count(*) FROM rollouts").fetchone()[0] == 0


def test_fsspec_uri_root(tmp_path):
    s = Store("file://" + str(tmp_path / "s"))
    s.commit("a", {"prompts": prompt_rows(3)})
    assert query.sql(s, "SELECT count(*) AS n FROM prompts").to_pylist() == [{"n": 3}]
    m = Store("memory://refinery-test-store")
    m.commit("a", {"prompts": prompt_rows(2)})
    assert m.landed(None, None, "a")
    assert query.scan(m, "prompts").collect().height == 2
    assert query.sql(m, "SELECT count(*) AS n FROM prompts").to_pylist() == [{"n": 2}]


def test_lineage_walks_both_ways(store):
    base = prompt_rows(1)
    root = base["prompt_id"][0].as_py()

    def child(pid, parent, transform):
        t = prompt_rows(1)
        return t.set_column(0, "prompt_id", pa.array([pid])).append_column(
            "parent_id", pa.array([parent])).set_column(4, "root_id", pa.array([root])).set_column(
            5, "transform", pa.array([transform]))

    store.commit("ingest", {"prompts": base})
    store.commit("refine", {"prompts": pa.concat_tables([
        conform("prompts", child("c1", root, "hint_prefix")),
        conform("prompts", child("c2", root, "mcq4")),
        conform("prompts", child("g1", "c2", "mcq10")),
    ])}, run_id="r", round=0)
    con = query.connect(store)
    tree = lineage(con, "g1")
    assert [a["prompt_id"] for a in tree["ancestors"]] == ["c2", root]
    down = lineage(con, root)["descendants"]
    assert [(d["depth"], d["prompt_id"]) for d in down] == [(1, "c1"), (1, "c2"), (2, "g1")]
    with pytest.raises(KeyError, match="no prompt with id 'zzz'"):
        lineage(con, "zzz")


def _tmp_folder(store, name, owner):
    tmp = store.path(".tmp", name)
    store.fs.makedirs(tmp)
    if owner is not None:
        store._write_text(tmp + "/owner.json", json.dumps(owner))
    return tmp


def test_cleanup_removes_debris_but_not_landed_data(store):
    import socket
    import time

    store.commit("a", {"prompts": prompt_rows(3)})
    host, now = socket.gethostname(), time.time()
    # debris of crashes: a dead owner on this host, a folder with no owner record, another host's old folder,
    # and a renamed stage folder with no commit record
    dead = _tmp_folder(store, "dead", {"pid": 2**22 + 7, "host": host, "created": now})
    ownerless = _tmp_folder(store, "ownerless", None)
    foreign_old = _tmp_folder(store, "foreign-old", {"pid": 1, "host": "elsewhere", "created": now - 2 * 86400})
    orphan = store.path("prompts", "run_id=r", "round=0", "stage=x")
    store.fs.makedirs(orphan)
    # kept: a live writer on this host, and a fresh folder of another host (whose writer may be alive)
    live = _tmp_folder(store, "live", {"pid": os.getpid(), "host": host, "created": now})
    foreign_new = _tmp_folder(store, "foreign-new", {"pid": 1, "host": "elsewhere", "created": now - 60})
    removed = store.cleanup()
    assert sorted(removed) == sorted([dead, ownerless, foreign_old, orphan])
    assert store.fs.exists(live) and store.fs.exists(foreign_new)
    assert query.scan(store, "prompts").collect().height == 3 and store.landed(None, None, "a")
    assert store.cleanup(now=now + 2 * 86400) == [foreign_new]  # a day later it is debris too


def test_cleanup_ages_an_old_foreign_owner_record_by_its_mtime(store):
    """Owner records written before `created` existed: another host's folder is aged by the record's
    modification time, so it is kept while fresh and removed once a day old (never kept forever)."""
    import time

    legacy = _tmp_folder(store, "legacy", {"pid": 1, "host": "elsewhere"})
    mtime = store.fs.modified(legacy + "/owner.json").timestamp()
    assert store.cleanup(now=mtime + 60) == [] and store.fs.exists(legacy)
    assert store.cleanup(now=max(mtime, time.time()) + 2 * 86400) == [legacy]


def test_newest_checkpoint_is_the_newest_trained_version_before_a_round(store, tmp_path):
    from datetime import UTC, datetime

    from models.checkpoints import policy_for_round
    from storage.checkpoints import checkpoint_versions, newest_checkpoint

    assert newest_checkpoint(store, "r", "base") == (0, "base") and checkpoint_versions(store, "r").height == 0
    now = datetime.now(UTC)

    def row(v, parent, rnd, path):
        return {"run_id": "r", "policy_version": v, "parent_version": parent, "round": rnd, "path": path,
                "created_at": now}

    (tmp_path / "v1").mkdir()
    store.commit("train", {"checkpoints": pa.Table.from_pylist(
        [row(0, None, 0, "/resolved/base"), row(1, 0, 0, str(tmp_path / "v1"))])}, run_id="r", round=0)
    store.commit("train", {"checkpoints": pa.Table.from_pylist([row(2, 1, 1, str(tmp_path / "v2"))])},
                 run_id="r", round=1)
    assert checkpoint_versions(store, "r")["policy_version"].to_list() == [0, 1, 2]
    assert newest_checkpoint(store, "r", "base") == (2, str(tmp_path / "v2"))
    assert newest_checkpoint(store, "r", "base", before_round=1) == (1, str(tmp_path / "v1"))
    assert newest_checkpoint(store, "r", "base", before_round=0) == (0, "base")  # the base, not v0's row
    assert policy_for_round(store, "r", 1, "base") == (1, str(tmp_path / "v1"))
    with pytest.raises(FileNotFoundError, match="checkpoint v2 is recorded at .*, but that folder is gone"):
        policy_for_round(store, "r", 2, "base")


def test_a_column_added_later_reads_where_it_was_written_even_behind_older_files(store, monkeypatch):
    """A store whose first rollouts file predates `token_ids` (an older run): polars' scan takes its columns
    from that file and hides the column everywhere; `table_rows_with_schema` reads it where it was written
    (null in the older file), for one run and round."""
    import polars as pl

    from storage.rounds import this_round

    def rows(run_id: str, ids) -> pa.Table:
        return pa.Table.from_pylist([{"run_id": run_id, "round": 0, "policy_version": 0, "prompt_id": "p",
                                      "sample_idx": 0, "prompt_text": "Q", "completion": "a", "reward": 1.0,
                                      "correct": True, "n_tokens": 1, "finish_reason": "stop",
                                      **({"token_ids": ids} if ids is not None else {})}])

    older = pa.schema([f for f in TABLES["rollouts"] if f.name not in ("token_ids", "token_logprobs")])
    with monkeypatch.context() as m:  # written by code from before the two columns
        m.setitem(TABLES, "rollouts", older)
        store.commit("collect", {"rollouts": rows("a-old", None)}, run_id="a-old", round=0)
    store.commit("collect", {"rollouts": rows("b-new", [7, 2])}, run_id="b-new", round=0)
    assert "token_ids" not in this_round(store, "rollouts", "b-new", 0).collect_schema().names()  # the trap
    got = query.table_rows_with_schema(store, "rollouts", ["run_id", "token_ids"], "b-new", 0)
    assert got.to_dicts() == [{"run_id": "b-new", "token_ids": [7, 2]}]
    both = query.table_rows_with_schema(store, "rollouts", ["run_id", "token_ids"]).sort("run_id")
    assert both["token_ids"].to_list() == [None, [7, 2]] and both.schema["token_ids"] == pl.List(pl.Int32)


def test_a_moved_store_still_finds_its_checkpoints(tmp_path, tiny_backend):
    """A local store records its own checkpoint folders relative to its root (storage/checkpoints.py), so a copy
    of the store elsewhere (a committed fixture, a moved evidence store) resolves them in the copy; an absolute
    path of an older row is read as it is."""
    import shutil
    from datetime import UTC, datetime

    from models.checkpoints import save_checkpoint
    from storage.checkpoints import newest_checkpoint, recorded_path

    first = Store(tmp_path / "a")
    saved = save_checkpoint(tiny_backend.model, tiny_backend.tokenizer, first, "m", 1)
    row = {"run_id": "m", "policy_version": 1, "parent_version": 0, "round": 0,
           "path": recorded_path(first, saved), "created_at": datetime.now(UTC)}
    first.commit("train", {"checkpoints": pa.Table.from_pylist([row])}, run_id="m", round=0)
    raw = q(first, "SELECT path FROM checkpoints")[0]["path"]
    assert raw == "_checkpoints/run_id=m/v1"  # no checkout, no machine in the row
    assert recorded_path(first, "/elsewhere/model") == "/elsewhere/model"  # not the store's own: as it is
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "a")
    version, path = newest_checkpoint(Store(tmp_path / "b"), "m", "base")
    assert version == 1 and path == str(tmp_path / "b" / "_checkpoints" / "run_id=m" / "v1")
    assert (tmp_path / "b" / "_checkpoints" / "run_id=m" / "v1" / "config.json").exists()


def test_a_built_in_base_is_recorded_by_name_and_found_on_any_machine(tmp_path):
    """Version 0 (and a version made by a round without an update) of a run on a built-in model names it
    (`tiny-random`), not this machine's model cache: another machine resolves the name in its own cache, the
    next round samples it, and `refinery eval` does not call it gone."""
    from datetime import UTC, datetime

    from models.checkpoints import checkpoint_gone, policy_for_round
    from models.registry import recorded_spec, resolve

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text("{}")
    assert recorded_spec("tiny-random") == "tiny-random"  # a folder of the user's is recorded resolved, as before
    assert recorded_spec(str(tmp_path / "." / "mine")) == str((tmp_path / "mine").resolve())
    store = Store(tmp_path / "s")
    rows = [{"run_id": "b", "policy_version": v, "parent_version": v - 1 if v else None, "round": 0,
             "path": recorded_spec("tiny-random"), "created_at": datetime.now(UTC)} for v in (0, 1)]
    store.commit("train", {"checkpoints": pa.Table.from_pylist(rows)}, run_id="b", round=0)
    assert q(store, "SELECT DISTINCT path FROM checkpoints") == [{"path": "tiny-random"}]
    assert policy_for_round(store, "b", 1, "tiny-random") == (1, "tiny-random")
    assert not checkpoint_gone(store, "tiny-random")
    assert os.path.isfile(os.path.join(resolve("tiny-random"), "config.json"))


def test_a_run_s_stored_config_names_the_store_it_is_read_from(tmp_path):
    """runs.config does not record where the run lives: the row is in that store. Read back, `store` is the store
    it was read from, for a moved store and for a row written before (which named its old path)."""
    import json
    import shutil
    from datetime import UTC, datetime

    from storage.runs import mark, stored_config

    first = Store(tmp_path / "a")
    mark(first, "m", "running", {"store": str(tmp_path / "a"), "rounds": 2})
    assert "store" not in json.loads(q(first, "SELECT config FROM runs")[0]["config"])
    old = {"run_id": "old", "created_at": datetime.now(UTC), "status": "completed",
           "config": json.dumps({"store": "/home/someone/checkout/store", "rounds": 3})}
    first.commit("completed-0", {"runs": pa.Table.from_pylist([old])}, run_id="old")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    moved = Store(tmp_path / "b")
    assert stored_config(moved, "m") == {"store": moved.uri, "rounds": 2}
    assert stored_config(moved, "old") == {"store": moved.uri, "rounds": 3}


def test_a_backend_is_named_by_its_weights_not_by_where_they_lie(tmp_path):
    """The teacher cache keys on the backend's name (tasks/strategies/teacher_calls.py call_key): a built-in
    model's cache folder is named by the built-in, a run's checkpoint by run and version wherever the store or
    its local copy lies, so a moved store still finds its teacher's answers; a folder of the user's is itself."""
    import shutil

    from models.cache import model_identity
    from models.hf.backend import TransformersBackend
    from models.registry import resolve
    from tasks.strategies.teacher_calls import call_key

    assert model_identity(resolve("tiny-random")) == "tiny-random"
    here, there = (str(p / "_checkpoints" / "run_id=r" / "v2") for p in (tmp_path / "a", tmp_path / "b"))
    assert model_identity(here) == model_identity(there) == "run_id=r/v2"
    for folder in (here, there):
        shutil.copytree(resolve("tiny-random"), folder)
    names = [TransformersBackend(folder, dtype="fp32").name for folder in (here, there, resolve("tiny-random"))]
    assert names == ["transformers:run_id=r/v2", "transformers:run_id=r/v2", "transformers:tiny-random"]
    assert call_key(names[0], "q") == call_key(names[1], "q") != call_key(names[2], "q")
    assert model_identity(str(tmp_path / "mine")) == str(tmp_path / "mine")
    assert model_identity("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
