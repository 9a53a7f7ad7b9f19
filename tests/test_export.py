"""`refinery export`: a run's curriculum (and its shaped traces) as Parquet datasets TRL, verl and an SFT
trainer read, with the columns docs/interop.md documents; and what it refuses (an OUT inside the store, a file
it would replace unasked, a round or run that is not there)."""

import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import q, run_cli
from test_import import TOK, write_verl

from storage.store import Store

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "data" / "golden" / "scripted"
INSTRUCTION = "Put your final answer within \\boxed{}."


@pytest.fixture
def golden(tmp_path):
    root = tmp_path / "store"
    shutil.copytree(GOLDEN, root)
    return Store(str(root))


def load(path):
    """What a trainer reads: `datasets.load_dataset("parquet", ...)` where installed, else pyarrow."""
    try:
        import datasets
    except ImportError:
        return pq.read_table(path).to_pylist()
    return list(datasets.load_dataset("parquet", data_files=str(path), split="train"))


def documented(fmt: str) -> list[str]:
    """The columns docs/interop.md's mapping table gives for `fmt` (rows `| column | formats | ... |`)."""
    text = (REPO / "docs" / "interop.md").read_text()
    cols = []
    for line in text.splitlines():
        m = re.match(r"\| `([a-z_]+)` \| ([a-z, ]+) \|", line)
        if m and fmt in [f.strip() for f in m.group(2).split(",")]:
            cols.append(m.group(1))
    return cols


@pytest.mark.parametrize("fmt", ["trl", "verl"])
def test_curriculum_export_is_the_rounds_pool_with_scores_and_selection(golden, tmp_path, fmt):
    out = tmp_path / f"{fmt}.parquet"
    code, stdout, err = run_cli("export", "scripted", str(out), "--format", fmt, "--round", "1", "--store", golden.root)
    assert code == 0, err
    rows = load(out)
    assert sorted(rows[0]) == sorted(documented(fmt)) and documented(fmt)
    pool = q(golden, "SELECT prompt_id, status FROM pool WHERE run_id = 'scripted' AND round = 1")
    trainable = {r["prompt_id"] for r in pool if r["status"] in ("active", "reserve")}
    heldout = {r["prompt_id"] for r in pool if r["status"] == "heldout"}
    assert heldout and {r["prompt_id"] for r in rows} == trainable and len(rows) == len(trainable)
    chosen = {r["prompt_id"]: r for r in q(golden, "SELECT prompt_id, cluster, weight FROM selections "
                                                   "WHERE run_id = 'scripted' AND round = 1")}
    assert {r["prompt_id"] for r in rows if r["selected"]} == set(chosen)
    assert f"{len(rows)} prompts ({len(chosen)} selected in round 1)" in stdout
    text = {r["prompt_id"]: r for r in q(golden, "SELECT prompt_id, text, answer, root_id, transform, source "
                                                 "FROM prompts")}
    latest = {r["prompt_id"]: r for r in q(golden, "SELECT prompt_id, arg_max(eps, round) AS eps, "
                                                   "arg_max(bucket, round) AS bucket FROM prompt_scores "
                                                   "WHERE run_id = 'scripted' AND round <= 1 GROUP BY prompt_id")}
    for r in rows:
        p = r["prompt_id"]
        assert r["prompt"] == [{"role": "user", "content": f"{text[p]['text']}\n{INSTRUCTION}"}]
        assert (r["answer"], r["root_id"], r["transform"], r["source"]) == (
            text[p]["answer"], text[p]["root_id"], text[p]["transform"], text[p]["source"])
        assert (r["eps"], r["bucket"]) == ((latest[p]["eps"], latest[p]["bucket"]) if p in latest else (None, None))
        if r["selected"]:
            assert (r["cluster"], r["weight"]) == (chosen[p]["cluster"], chosen[p]["weight"])
        if fmt == "verl":
            assert r["reward_model"] == {"style": "rule", "ground_truth": r["answer"]}
            assert r["data_source"] == text[p]["source"] and r["extra_info"]["prompt_id"] == p
    assert any(r["transform"] != "original" for r in rows)  # the evolved pool: variants are in it


def test_sft_export_is_the_correct_shaped_traces_as_chat(golden, tmp_path):
    out = tmp_path / "sft.parquet"
    code, _, err = run_cli("export", "scripted", str(out), "--format", "sft", "--store", golden.root)
    assert code == 0, err
    rows = load(out)
    traces = q(golden, "SELECT trace_id, text FROM shaped_traces WHERE run_id = 'scripted' AND correct")
    assert sorted(r["trace_id"] for r in rows) == sorted(t["trace_id"] for t in traces)
    assert sorted(rows[0]) == sorted(documented("sft"))
    by_id = {t["trace_id"]: t["text"] for t in traces}
    for r in rows:
        assert [m["role"] for m in r["messages"]] == ["user", "assistant"]
        assert r["messages"][1]["content"] == by_id[r["trace_id"]] and r["messages"][0]["content"].endswith(INSTRUCTION)


def test_an_imported_run_exports_what_it_rolled_out(store, tmp_path):
    write_verl(tmp_path / "dump")
    assert run_cli("import", "verl", str(tmp_path / "dump"), "--run-id", "ext", "--store", store.root, *TOK)[0] == 0
    out = tmp_path / "ext.parquet"
    code, _, err = run_cli("export", "ext", str(out), "--store", store.root)
    assert code == 0, err
    rows = load(out)
    assert len(rows) == 3 and all(r["selected"] for r in rows) and all(r["weight"] is None for r in rows)
    assert all(r["prompt"][0]["content"].startswith("system\n") for r in rows)  # the text as imported, no instruction
    assert {r["bucket"] for r in rows} == {"saturated", "informative", "too_hard"}


def test_what_export_refuses(golden, tmp_path):
    inside = Path(golden.root) / "rollouts" / "x.parquet"
    cases = [
        (["scripted", str(inside)], "is inside the store"),
        (["scripted", str(tmp_path / "nowhere" / "x.parquet")], "does not exist"),
        (["scripted", str(tmp_path)], "is a folder"),
        (["scripted", "s3://bucket/x.parquet"], "writes a local file"),
        (["nope", str(tmp_path / "a.parquet")], "no run 'nope'"),
        (["scripted", str(tmp_path / "a.parquet"), "--round", "7"], "has no round 7"),
    ]
    before = sorted(p.name for p in (Path(golden.root) / "rollouts").rglob("*"))
    for args, message in cases:
        code, out, err = run_cli("export", *args, "--store", golden.root)
        assert code == 1 and message in err and err.count("\n") <= 2, (args, err)
    assert sorted(p.name for p in (Path(golden.root) / "rollouts").rglob("*")) == before
    out = tmp_path / "keep.parquet"
    out.write_bytes(b"the user's file")
    code, _, err = run_cli("export", "scripted", str(out), "--store", golden.root)
    assert code == 1 and "exists; pass --overwrite" in err and out.read_bytes() == b"the user's file"
    assert run_cli("export", "scripted", str(out), "--overwrite", "--store", golden.root)[0] == 0
    assert pq.read_table(out).num_rows > 0
    assert not list(tmp_path.glob(".*.tmp"))


def test_sft_export_without_correct_traces_is_refused(tmp_path):
    root = tmp_path / "tiny"
    shutil.copytree(REPO / "tests" / "data" / "golden" / "tiny", root)
    code, _, err = run_cli("export", "tiny", str(tmp_path / "t.parquet"), "--format", "sft", "--store", str(root))
    assert code == 1 and "no correct shaped trace" in err and not (tmp_path / "t.parquet").exists()
