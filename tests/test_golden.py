"""Behaviour and stores outlive code changes (tests/golden.py, tests/data/golden/).

1. The same seeded run writes the same rows in every table as the code of MANIFEST.json's commit did.
2. A store that code wrote still opens, answers the same SQL, and resumes its run to a further round, leaving
   every row it held as it was."""

import json
import shutil

import polars as pl
import pytest
from conftest import ROOT
from golden import RUNS, answers, frames_match, row_digest, table_rows, tables

from flows.config import load_config
from storage.store import Store

GOLDEN = ROOT / "tests" / "data" / "golden"
MANIFEST = json.loads((GOLDEN / "MANIFEST.json").read_text())


@pytest.mark.parametrize("name", ["scripted", "tiny"])
def test_the_seeded_run_writes_the_golden_rows(prefect_api, tmp_path, monkeypatch, name):
    from flows.curriculum import curriculum

    monkeypatch.chdir(ROOT)  # the runs name their source files relative to the repository
    spec = RUNS[name]
    store = Store(tmp_path / "store")
    curriculum(load_config(sets=spec["sets"], run_id=name, store=store.root, rounds=spec["rounds"]))
    golden = Store(GOLDEN / name)
    assert row_digest(golden) == MANIFEST["runs"][name]["digest"], "the golden store differs from what MANIFEST records"
    assert tables(store) == tables(golden)
    for t in tables(golden):
        assert frames_match(table_rows(golden, t), table_rows(store, t)) is None, \
            f"{name}: table {t}: {frames_match(table_rows(golden, t), table_rows(store, t))}"


def test_an_old_store_answers_the_same_sql_and_resumes(prefect_api, tmp_path, monkeypatch):
    from flows.curriculum import curriculum

    monkeypatch.chdir(ROOT)
    shutil.copytree(GOLDEN / "resume", tmp_path / "store")
    store = Store(tmp_path / "store")
    assert answers(store, "resume") == MANIFEST["runs"]["resume"]["sql"]
    before = {t: table_rows(store, t) for t in tables(store)}
    spec = RUNS["resume"]
    out = curriculum(load_config(sets=spec["sets"], run_id="resume", store=store.root, rounds=spec["rounds"] + 1))
    ran = {(s["stage"], s["round"]) for s in out["stages"] if "skipped" not in s}
    assert ("collect", 2) in ran and ("score", 2) in ran and ("collect", 0) not in ran
    assert ("refine", 1) in ran  # the last round of the old run had no children to make; now it has
    for t, old in before.items():
        now = table_rows(store, t)
        if t == "runs":
            assert now["status"].to_list() == ["completed", "completed", "resumed", "running"]
            continue
        if t in ("prompts", "embeddings"):  # content-addressed: the rows the old store held are still there
            now = now.join(old.select("prompt_id"), on="prompt_id", how="semi")
        elif "round" in now.columns:
            now = now.filter(pl.col("round") < (1 if t == "refinements" else 2))
        assert frames_match(old, now) is None, f"table {t} changed on resume: {frames_match(old, now)}"
    assert answers(store, "resume")["buckets"][:len(MANIFEST["runs"]["resume"]["sql"]["buckets"])] \
        == MANIFEST["runs"]["resume"]["sql"]["buckets"]


def test_json_text_columns_compare_their_floats_within_tolerance():
    """A float inside a JSON text column (augmentation) moves with training's float rounding like a float
    column does; anything else in the text still has to match exactly."""
    def one(text):
        return pl.DataFrame({"augmentation": [text]})

    base = '{"lorem_perturb": {"behaviour_mean_logprob": -13.321943101428804, "prefix": 1, "replaced": true}}'
    assert frames_match(one(base), one(base.replace("101428804", "464733305"))) is None
    assert frames_match(one(base), one(base.replace("-13.32", "-14.32"))) is not None
    assert frames_match(one(base), one(base.replace('"prefix": 1', '"prefix": 2'))) is not None
    assert frames_match(one(base), one(base.replace("true", "false"))) is not None
    assert frames_match(one("plain text"), one("plain text!")) is not None
    assert frames_match(one('{"x": 1.0}'), one('{"x": true}')) is not None


def test_the_golden_stores_name_no_path_of_the_machine_that_wrote_them():
    """Committed stores travel: no text in them names this checkout, a model cache or a home or scratch folder
    (a run's config names no store; a checkpoint row names a store-relative folder or a built-in model:
    make_stores.py `scrub`; a teacher is named by its weights: models/cache.py `model_identity`), and no
    lock file is committed with them."""
    import pyarrow.parquet as pq

    from models.cache import BUILT_IN, cache_root

    machine = (str(ROOT), str(cache_root()), "/home/", "/root/", "/tmp/")
    files = sorted(GOLDEN.rglob("*"))
    assert not [f for f in files if f.is_file() and (f.suffix == ".lock" or ".locks" in f.parts)]
    for file in (f for f in files if f.suffix == ".parquet"):
        data = pq.read_table(file)
        for column in (c for c in data.column_names if str(data.schema.field(c).type) in ("string", "large_string")):
            named = [v for v in data[column].to_pylist() if v and any(m in v for m in machine)]
            assert not named, f"{file.relative_to(GOLDEN)}: {column} names a machine path: {named[0][:120]}"
    for table, column in (("runs", "config"), ("checkpoints", "path")):
        values = [v for f in sorted(GOLDEN.glob(f"*/{table}/**/*.parquet")) for v in pq.read_table(f)[column].to_pylist()]
        assert values
        if table == "runs":
            assert all("store" not in json.loads(v) for v in values)
        else:
            assert all(v in BUILT_IN or v.startswith("_checkpoints/") for v in values), values
