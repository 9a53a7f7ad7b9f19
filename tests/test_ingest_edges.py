"""Ingest's edges (issue 47, items 4 and 8): a file whose every row is bad, a number past Python's 4,300-digit
limit or arrays nested past its recursion limit on one line, a UTF-8 byte order mark, an unsupported file type,
a landed data file with junk over its ids, and a machine's first ingest. Each is a row problem or one line that
names the file, never a traceback, a bug hint or a Prefect warning, and a refused command writes nothing.

The user-visible cases run the real `refinery` entry point (tests/test_cli_errors.py `refinery`); the line
reader's cases also run in-process over the import readers that share it (tasks/core/dumps.py)."""

import codecs
import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from conftest import store_digest
from test_cli_errors import REFINERY, assert_one_line_error, refinery

from storage.query import sql
from tasks.core.dumps import read_dump
from tasks.core.sources import MAX_DEPTH, read_jsonl
from tasks.ingest import ingest_source

BUG_HINT = "this looks like a bug"
GOOD = json.dumps({"question": "What is 1 + 1?", "answer": "2"})
BIG = '{"question": "What is 2 + 2?", "answer": "4", "meta": {"n": ' + "9" * 5000 + "}}"
DEEP = '{"question": "What is 3 + 3?", "answer": "6", "meta": {"n": ' + "[" * 2000 + "]" * 2000 + "}}"
JUST_TOO_DEEP = '{"question": "q", "answer": "6", "meta": {"n": ' + "[" * MAX_DEPTH + "]" * MAX_DEPTH + "}}"
DEEPEST_ALLOWED = '{"question": "q", "answer": "6", "meta": {"n": ' + "[" * (MAX_DEPTH - 2) + "]" * (MAX_DEPTH - 2) + "}}"


def _paths(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# ---- every row bad ---------------------------------------------------------------------------------------------
def test_every_row_bad_under_skip_invalid_lands_nothing_and_writes_nothing(tmp_path):
    (tmp_path / "all-bad.jsonl").write_text('{"question": "no answer"}\n{"answer": "1"}\n[1]\n')
    p = refinery("ingest", "all-bad.jsonl", "--skip-invalid", "--store", "S", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [
        "all-bad.jsonl: 3 rows read, 0 new prompts landed, 0 already in the store, 0 duplicates within the source, "
        "3 invalid rows skipped"]
    assert p.stderr.splitlines() == ["skipped all-bad.jsonl line 1: field 'answer' is missing",
                                     "skipped all-bad.jsonl line 2: field 'question' is missing",
                                     "skipped all-bad.jsonl line 3: expected a JSON object, got list"]
    assert not (tmp_path / "S").exists()  # no store, no Prefect home in it: no flow ran


def test_every_row_bad_leaves_an_existing_store_as_it_was(store, tmp_path):
    ingest_source(store, "rg:products", size=3, seed=0)
    root = tmp_path / "store"
    paths, digest = _paths(root), store_digest(root)
    (tmp_path / "all-bad.jsonl").write_text('{"question": "no answer"}\n')
    p = refinery("ingest", "all-bad.jsonl", "--skip-invalid", "--store", str(root), cwd=tmp_path)
    assert p.returncode == 0 and "0 new prompts landed" in p.stdout, p.stderr
    assert (_paths(root), store_digest(root)) == (paths, digest)  # .prefect and .locks included: nothing made


def test_every_row_bad_in_the_flow_lands_no_stage(store, tmp_path):
    """The flow's own path (a `refinery serve` deployment reaches it without the CLI's check): no Arrow crash."""
    (tmp_path / "all-bad.jsonl").write_text('{"question": "no answer"}\n{"answer": "1"}\n')
    s = ingest_source(store, str(tmp_path / "all-bad.jsonl"), skip_invalid=True)
    assert (s.read, s.new, len(s.skipped), s.stage) == (2, 0, 2, None)
    assert store.records() == []


# ---- one line Python's json cannot hold -------------------------------------------------------------------------
@pytest.mark.parametrize("line,problem", [
    (BIG, "a number too long to read: 5,000 digits, over Python's limit of 4,300"),
    (DEEP, f"arrays or objects nested deeper than {MAX_DEPTH} levels"),          # json.loads' RecursionError
    (JUST_TOO_DEEP, f"arrays or objects nested deeper than {MAX_DEPTH} levels"),  # read, then walked
], ids=["big-integer", "deep", "just-too-deep"])
def test_a_line_python_cannot_hold_is_a_bad_row(tmp_path, line, problem):
    f = tmp_path / "prompts.jsonl"
    f.write_text(GOOD + "\n" + line + "\n" + DEEPEST_ALLOWED + "\n")
    records, bad = read_jsonl(f)
    assert [n for n, _ in records] == [1, 3]
    assert [str(b) for b in bad] == [f"prompts.jsonl line 2: {problem}"]


@pytest.mark.parametrize("fmt,name", [("plain", "dump.jsonl"), ("verl", "1.jsonl")])
@pytest.mark.parametrize("value,problem", [("9" * 5000, "a number too long to read: 5,000 digits"),
                                           ("[" * 2000 + "]" * 2000, "nested deeper than")], ids=["big-integer", "deep"])
def test_the_import_readers_share_the_line_reader(tmp_path, fmt, name, value, problem):
    row = json.dumps({"prompt": "What is 1 + 1?", "completion": "2", "reward": 1.0,  # plain's fields
                      "input": "What is 1 + 1?", "output": "2", "score": 1.0, "step": 1})  # verl's
    (tmp_path / "dump").mkdir()
    (tmp_path / "dump" / name).write_text(row + "\n" + row[:-1] + ', "extra": ' + value + "}\n")
    rows, bad = read_dump(fmt, str(tmp_path / "dump" / name) if fmt == "plain" else str(tmp_path / "dump"))
    assert len(rows) == 1 and [b.line for b in bad] == [2] and bad[0].file.endswith(name)
    assert problem in bad[0].problem


def test_a_big_integer_is_a_bad_row_through_the_cli(tmp_path):
    (tmp_path / "prompts.jsonl").write_text(GOOD + "\n" + BIG + "\n")
    p = refinery("ingest", "prompts.jsonl", "--store", "S", cwd=tmp_path)
    assert_one_line_error(p, "prompts.jsonl line 2: a number too long to read: 5,000 digits")
    assert BUG_HINT not in p.stderr and not (tmp_path / "S").exists()  # refused before Prefect made its home
    p = refinery("ingest", "prompts.jsonl", "--skip-invalid", "--store", "S", cwd=tmp_path)
    assert p.returncode == 0 and "1 new prompts landed" in p.stdout and "1 invalid rows skipped" in p.stdout, p.stderr
    assert p.stderr.splitlines() == ["skipped prompts.jsonl line 2: a number too long to read: 5,000 digits, over "
                                     "Python's limit of 4,300"]


def test_a_big_integer_in_a_dump_is_a_bad_row_through_the_cli(tmp_path):
    dump = tmp_path / "dump.jsonl"
    dump.write_text(json.dumps({"prompt": "What is 1 + 1?", "completion": "2", "reward": 1.0}) + "\n"
                    + '{"prompt": "q", "completion": "c", "reward": ' + "9" * 5000 + "}\n")
    p = refinery("import", "plain", "dump.jsonl", "--run-id", "r", "--tokenizer", "tiny-random", "--store", "S",
                 cwd=tmp_path)
    assert_one_line_error(p, "dump.jsonl line 2: a number too long to read: 5,000 digits")
    assert BUG_HINT not in p.stderr and not (tmp_path / "S").exists()


# ---- a byte order mark --------------------------------------------------------------------------------------------
def test_a_byte_order_mark_is_skipped(tmp_path):
    (tmp_path / "bom.jsonl").write_bytes(codecs.BOM_UTF8 + GOOD.encode() + b"\n")
    p = refinery("ingest", "bom.jsonl", "--store", "S", cwd=tmp_path)
    assert p.returncode == 0 and "1 new prompts landed" in p.stdout, p.stderr
    from storage.store import Store

    assert sql(Store(tmp_path / "S"), "SELECT text, answer FROM prompts").to_pylist() == [
        {"text": "What is 1 + 1?", "answer": "2"}]  # the first key read as 'question', not '\ufeffquestion'


def test_a_byte_order_mark_alone_is_no_rows(tmp_path):
    (tmp_path / "bom.jsonl").write_bytes(codecs.BOM_UTF8 + b"\n\n")
    assert_one_line_error(refinery("ingest", "bom.jsonl", "--store", "S", cwd=tmp_path), "bom.jsonl: no rows")
    assert not (tmp_path / "S").exists()


# ---- a file type ingest does not read -------------------------------------------------------------------------------
@pytest.mark.parametrize("name,kind", [("prompts.txt", "'.txt'"), ("prompts.JSON", "'.json'"), ("prompts", "'(none)'")])
def test_an_unsupported_file_type_is_refused_before_prefect(tmp_path, name, kind):
    (tmp_path / name).write_text(GOOD + "\n")
    p = refinery("ingest", name, "--store", "S", cwd=tmp_path)
    assert_one_line_error(p, f"{name}: unsupported file type {kind}", "use .jsonl or .parquet")
    assert not (tmp_path / "S").exists()  # Prefect (whose home is S/.prefect) never started


# ---- a landed file with junk over its ids ---------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["page-header", "page-data"])
def test_a_corrupt_landed_file_is_named_in_one_line(store, tmp_path, where):
    """Junk over the pages of a landed file's prompt_id column, its footer intact (so the store's footer check,
    storage/integrity.py, passes it): the ingest that reads the landed ids to deduplicate names the file. It
    used to fail in polars with a ComputeError that named no file, and the bug hint."""
    ingest_source(store, "rg:products", size=20, seed=0)
    part = next((tmp_path / "store" / "prompts").rglob("*.parquet"))
    meta = pq.ParquetFile(part).metadata
    chunk = meta.row_group(0).column(meta.schema.names.index("prompt_id"))
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    at = start if where == "page-header" else start + chunk.total_compressed_size // 2
    data = bytearray(part.read_bytes())
    data[at:at + 32] = b"\xff" * 32
    part.write_bytes(bytes(data))
    before = store_digest(tmp_path / "store")
    p = refinery("ingest", "rg:products", "--size", "5", "--seed", "9", "--store", str(tmp_path / "store"),
                 cwd=tmp_path)
    rel = str(part.relative_to(tmp_path / "store"))
    assert_one_line_error(p, f"prompts data file {rel} is corrupt", "restore it from a copy of the store")
    assert BUG_HINT not in p.stderr and "ComputeError" not in p.stderr
    assert store_digest(tmp_path / "store") == before


# ---- a machine's first ingest ---------------------------------------------------------------------------------------
def test_a_machine_s_first_ingest_prints_no_warning(tmp_path):
    """A new HOME and an empty Refinery cache: no migrated Prefect database yet, so the command checks its input
    before making the store and Prefect's home. Prefect's import then tried to make `S/.prefect` under a store
    that did not exist yet and warned ("Failed to create the Prefect home directory") on a successful ingest."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "REFINERY_", "XDG_"))}
    env |= {"HOME": str(tmp_path / "home"), "REFINERY_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    (tmp_path / "home").mkdir()
    cmd = [str(REFINERY)] if REFINERY.exists() else [sys.executable, "-m", "flows.cli"]
    p = subprocess.run([*cmd, "ingest", "rg:products", "--size", "5", "--store", str(tmp_path / "new" / "S")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and p.stdout.startswith("rg:products: 5 rows read, 5 new prompts landed"), p.stderr
    assert p.stderr == ""
    assert (tmp_path / "cache").exists()  # it was the first run: the migrated database was made now
