"""Every `refinery export` writes a Hugging Face dataset card (tasks/interop/card.py): `<stem>.md` beside a file
OUT, `README.md` in a folder OUT's dataset-repo layout; loaded with `huggingface_hub.DatasetCard` (in the locked
venv), its features, configs, license and the run's provenance are checked against the written data and the
store. Also: folder OUTs are replaced only when an earlier export wrote them, and a failed export leaves nothing."""

import hashlib
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import q, run_cli
from huggingface_hub import DatasetCard

from storage.store import Store
from tasks.interop import export_run as export_module

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "data" / "golden" / "scripted"


@pytest.fixture
def golden(tmp_path):
    root = tmp_path / "store"
    shutil.copytree(GOLDEN, root)
    return Store(str(root))


def names(features: list[dict]) -> list[str]:
    return [f["name"] for f in features]


def check_provenance(store: Store, meta: dict) -> None:
    run = q(store, "SELECT config, \"commit\", dirty FROM runs WHERE run_id = 'scripted' ORDER BY created_at")[-1]
    canonical = json.dumps(json.loads(run["config"]), sort_keys=True, separators=(",", ":"))
    assert (meta["commit"], meta["dirty"]) == (run["commit"], run["dirty"])
    assert meta["config_digest"] == "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def test_a_file_export_has_its_card_beside_it(golden, tmp_path):
    out = tmp_path / "curriculum.parquet"
    code, _, err = run_cli("export", "scripted", str(out), "--round", "1", "--store", golden.root)
    assert code == 0, err
    card = DatasetCard.load(tmp_path / "curriculum.md")
    data, table = card.data.to_dict(), pq.read_table(out)
    assert data["license"] == "other" and "set it" in card.text and "trl" in data["tags"]
    assert data["configs"] == [{"config_name": "default", "data_files": [{"split": "train",
                                                                          "path": "curriculum.parquet"}]}]
    info = data["dataset_info"]
    assert names(info["features"]) == table.column_names
    assert info["splits"] == [{"name": "train", "num_examples": table.num_rows}]
    features = {f["name"]: f for f in info["features"]}
    assert features["prompt"]["list"] == [{"name": "role", "dtype": "string"}, {"name": "content", "dtype": "string"}]
    assert features["selected"]["dtype"] == "bool" and features["eps"]["dtype"] == "float64"
    meta = data["refinery"]
    selected = sum(table["selected"].to_pylist())
    assert (meta["run_id"], meta["format"], meta["round"], meta["rows"], meta["selected"]) == (
        "scripted", "trl", 1, table.num_rows, selected)
    check_provenance(golden, meta)


def test_a_folder_export_is_a_dataset_repo(golden, tmp_path):
    out = tmp_path / "repo"
    code, _, err = run_cli("export", "scripted", str(out), "--format", "verl", "--license", "apache-2.0",
                           "--store", golden.root)
    assert code == 0, err
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [
        "README.md", "data", "data/train-00000-of-00001.parquet"]
    card = DatasetCard.load(out / "README.md")
    data = card.data.to_dict()
    (config,) = data["configs"]
    (files,) = config["data_files"]
    table = pq.read_table(out / files["path"])
    assert data["license"] == "apache-2.0" and files["split"] == "train"
    assert names(data["dataset_info"]["features"]) == table.column_names
    features = {f["name"]: f for f in data["dataset_info"]["features"]}
    assert features["reward_model"]["struct"] == [{"name": "style", "dtype": "string"},
                                                  {"name": "ground_truth", "dtype": "string"}]
    check_provenance(golden, data["refinery"])
    # again: refused without --overwrite, replaced with it; a folder an export did not write is never replaced
    assert "pass --overwrite" in run_cli("export", "scripted", str(out), "--store", golden.root)[2]
    assert run_cli("export", "scripted", str(out), "--format", "sft", "--overwrite", "--store", golden.root)[0] == 0
    assert DatasetCard.load(out / "README.md").data.to_dict()["refinery"]["format"] == "sft"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    code, _, err = run_cli("export", "scripted", str(mine), "--overwrite", "--store", golden.root)
    assert code == 1 and "holds other files" in err and [p.name for p in mine.iterdir()] == ["notes.txt"]
    assert not list(tmp_path.glob(".*.tmp")) and not list(tmp_path.glob(".*.old"))


def test_the_lm_eval_export_card_names_each_task_set(golden, tmp_path):
    out = tmp_path / "lm"
    assert run_cli("export", "scripted", "--heldout", "--format", "lm-eval", str(out), "--store", golden.root)[0] == 0
    data = DatasetCard.load(out / "README.md").data.to_dict()
    assert data["configs"] == [{"config_name": "heldout", "data_files": [{"split": "test",
                                                                          "path": "data/heldout.jsonl"}]}]
    assert names(data["dataset_info"]["features"]) == ["prompt_id", "question", "prompt", "answer", "source"]
    n = len((out / "data" / "heldout.jsonl").read_text().splitlines())
    assert data["dataset_info"]["splits"] == [{"name": "test", "num_examples": n}] and data["refinery"]["rows"] == n
    check_provenance(golden, data["refinery"])


@pytest.mark.parametrize("out", ["x.parquet", "folder"])
def test_a_failed_export_leaves_nothing(golden, tmp_path, monkeypatch, out):
    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(export_module, "card", broken)
    with pytest.raises(OSError, match="disk full"):
        export_module.export_run(golden, "scripted", "trl", str(tmp_path / out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


def test_a_license_must_be_one_line(golden, tmp_path):
    code, _, err = run_cli("export", "scripted", str(tmp_path / "a.parquet"), "--license", " ", "--store",
                           golden.root)
    assert code == 1 and "--license" in err and not (tmp_path / "a.parquet").exists()
