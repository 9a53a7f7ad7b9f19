"""A store someone hands you, and the arguments that name it (issue 47 items 5, 6 and 8's path and Prefect
messages): each refusal is one line through the real `refinery` entry point, naming the input and what it is,
and leaves the store byte-identical (`_digest`: every path under it, its kind and its bytes, Prefect's home and
the lock files included) or, for a store that does not exist, creates nothing.

The store is the issue's `S`: `refinery ingest rg:products --size 20 --store S`, plus run `r` from `refinery
import plain` (a report needs a run). Each test damages or names its own copy.
"""

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_cli_errors import assert_one_line_error, refinery

PART = "prompts/run_id=_ingest/round=_"  # where S's ingested prompts landed (one stage, one part)


def _digest(root: Path) -> str:
    """sha256 over every path under `root`: its name, its kind, a file's bytes and a link's target."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        mode = p.lstat().st_mode
        kind = "link" if stat.S_ISLNK(mode) else "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) \
            else "other"  # a FIFO: never read (it would block)
        h.update(f"{p.relative_to(root)}\0{kind}\0".encode())
        h.update(os.readlink(p).encode() if kind == "link" else p.read_bytes() if kind == "file" else b"")
    return h.hexdigest()


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("handed")
    p = refinery("ingest", "rg:products", "--size", "20", "--store", "S", cwd=folder)
    assert p.returncode == 0, p.stderr
    rows = [{"prompt": f"What is {i} + {i}?", "completion": f"\\boxed{{{2 * i}}}", "reward": float(i % 2)}
            for i in range(4)]
    (folder / "dump.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = refinery("import", "plain", "dump.jsonl", "--run-id", "r", "--tokenizer", "tiny-random", "--store", "S",
                 cwd=folder)
    assert p.returncode == 0, p.stderr
    return folder


@pytest.fixture
def work(base, tmp_path) -> Path:
    """A folder holding a copy of S and the dump."""
    shutil.copytree(base / "S", tmp_path / "S", symlinks=True)
    shutil.copy(base / "dump.jsonl", tmp_path / "dump.jsonl")
    return tmp_path


def _part(work: Path) -> Path:
    """The part file of S's 20 ingested prompts (the import landed its 4 prompts in a stage of their own)."""
    (part,) = [p for p in (work / "S" / PART).glob("stage=*/part-0.parquet") if pq.read_metadata(p).num_rows == 20]
    return part


def _count(work: Path, store: str = "S", **kw) -> int:
    p = refinery("sql", "SELECT count(*) AS n FROM prompts", "--format", "json", "--store", store, cwd=work, **kw)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    return json.loads(p.stdout)[0]["n"]


READS = [["sql", "SELECT * FROM prompts"], ["catalog"], ["export", "r", "out.parquet"], ["report", "r"]]
READ_IDS = ["sql", "catalog", "export", "report"]


# ---- item 5: landed files that are not what their commit record says ------------------------------------

@pytest.mark.parametrize("args", READS, ids=READ_IDS)
def test_a_landed_file_that_is_a_symbolic_link_is_refused_naming_it(work, args):
    part = _part(work)
    outside = work / "outside.parquet"
    shutil.move(part, outside)
    os.symlink(outside, part)
    before = _digest(work / "S")
    p = refinery(*args, "--store", "S", cwd=work)
    assert_one_line_error(p, str(part.relative_to(work / "S")), "is a symbolic link")
    assert p.stdout == "" and _digest(work / "S") == before and not (work / "out.parquet").exists()


def test_another_table_s_file_in_a_prompts_file_s_place_is_refused_naming_it(work):
    part = _part(work)
    (rollouts,) = (work / "S" / "rollouts").rglob("part-0.parquet")
    shutil.copy(rollouts, part)  # before: 20 rows of nulls, no error
    before = _digest(work / "S")
    line = assert_one_line_error(refinery("sql", "SELECT count(*) FROM prompts", "--store", "S", cwd=work),
                                 str(part.relative_to(work / "S")), "prompts")
    assert "columns" in line and "completion" in line  # says which columns are not the table's
    assert _digest(work / "S") == before


def test_a_shared_column_of_another_type_is_refused_naming_it(work):
    part = _part(work)
    t = pq.read_table(part)
    t = t.set_column(t.schema.get_field_index("answer"), "answer", pa.array(range(t.num_rows), pa.int64()))
    pq.write_table(t, part)
    before = _digest(work / "S")
    assert_one_line_error(refinery("sql", "SELECT answer FROM prompts", "--store", "S", cwd=work),
                          str(part.relative_to(work / "S")), "'answer'", "int64")
    assert _digest(work / "S") == before


def test_a_file_written_before_a_column_was_added_still_reads_with_nulls(work):
    part = _part(work)
    pq.write_table(pq.read_table(part).drop_columns(["meta", "external_id"]), part)
    p = refinery("sql", "SELECT count(*) AS n, count(external_id) AS e, count(answer) AS a FROM prompts", "--format",
                 "json", "--store", "S", cwd=work)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert json.loads(p.stdout) == [{"n": 20 + 4, "e": 0, "a": 20 + 4}]  # the import's prompts are in another part


# ---- item 6: store arguments ----------------------------------------------------------------------------

@pytest.mark.parametrize("args", [["sql", "SELECT 1"], ["ingest", "rg:products", "--size", "3"],
                                  ["import", "plain", "dump.jsonl", "--run-id", "e", "--tokenizer", "tiny-random"]],
                         ids=["sql", "ingest", "import"])
def test_an_empty_store_argument_is_refused(work, args):
    """`sql --store ""` read the working folder as a store while `ingest` wrote ./refinery-store."""
    listing = sorted(os.listdir(work))
    assert_one_line_error(refinery(*args, "--store", "", cwd=work), "--store is empty")
    assert sorted(os.listdir(work)) == listing


def test_an_empty_refinery_store_variable_counts_as_unset(work):
    shutil.copytree(work / "S", work / "refinery-store", symlinks=True)  # the default, ./refinery-store
    p = refinery("sql", "SELECT count(*) AS n FROM prompts", "--format", "json", cwd=work,
                 env={"REFINERY_STORE": ""})
    assert p.returncode == 0 and json.loads(p.stdout) == [{"n": 24}], p.stderr


@pytest.mark.parametrize("args", [*READS, ["lineage", "abc"]], ids=[*READ_IDS, "lineage"])
@pytest.mark.parametrize("folder", ["notes", "empty"])
def test_a_folder_that_is_not_a_store_is_refused_for_reads(work, args, folder):
    (work / folder).mkdir()
    if folder == "notes":
        (work / folder / "notes.txt").write_text("my notes")
    before = _digest(work)
    p = refinery(*args, "--store", folder, cwd=work)
    assert_one_line_error(p, f"{folder} is not a Refinery store: it has no _landed/ folder")
    assert p.stdout == "" and _digest(work) == before  # no zero-row table, no catalog, no .prefect


def test_a_write_command_makes_a_store_in_an_empty_folder(work):
    (work / "fresh").mkdir()
    p = refinery("import", "plain", "dump.jsonl", "--run-id", "e", "--tokenizer", "tiny-random", "--store", "fresh",
                 cwd=work)
    assert p.returncode == 0, p.stderr
    assert _count(work, "fresh") == 4


@pytest.mark.parametrize("args", [["ingest", "rg:products", "--size", "3"], ["run", "--rounds", "1"],
                                  ["import", "plain", "dump.jsonl", "--run-id", "e", "--tokenizer", "tiny-random"],
                                  ["compare", "--arms", "uniform", "--seeds", "1"]],
                         ids=["ingest", "run", "import", "compare"])
def test_a_memory_store_is_refused_for_commands_that_write(work, args):
    """`ingest --store memory://x` said "20 new prompts landed" and exited 0; the prompts died with it."""
    listing = sorted(os.listdir(work))
    p = refinery(*args, "--store", "memory://x", cwd=work)
    assert_one_line_error(p, "memory://x", "gone when it ends")
    assert p.stdout == "" and sorted(os.listdir(work)) == listing


@pytest.mark.parametrize("out", ["S/_landed/rep", "S/prompts/rep", "S/.tmp/rep", "S/.locks/rep", "S/.prefect/rep",
                                 "S", "S/_landed/../_landed"])
def test_a_report_in_the_store_s_own_folders_is_refused(work, out):
    """`report --out S/_landed/rep` was accepted, and every later command warned of 5 stray files."""
    before = _digest(work / "S")
    assert_one_line_error(refinery("report", "r", "--out", out, "--store", "S", cwd=work), f"--out {out} is ")
    assert _digest(work / "S") == before
    assert _count(work) == 24  # and no warning: _count asserts an empty stderr


def test_a_report_beside_the_default_one_is_drawn(work):
    p = refinery("report", "r", "--out", "S/_reports/mine", "--store", "S", cwd=work)
    assert p.returncode == 0 and (work / "S/_reports/mine/index.html").is_file(), p.stderr
    assert _count(work) == 24


# ---- item 8: say what the store path is; name the Prefect setting ----------------------------------------

def _not_folders(work: Path) -> dict[str, str]:
    os.mkfifo(work / "fifo")
    os.symlink(work / "loop-b", work / "loop-a")
    os.symlink(work / "loop-a", work / "loop-b")
    (work / "afile").write_text("a file")
    return {"fifo": "is a FIFO", "/dev/null": "is a character device", "loop-a": "is a symbolic link loop",
            "loop-a/S": "is a symbolic link loop", "afile/S": "a folder on its path is a file"}


@pytest.mark.parametrize("args", [["sql", "SELECT 1"], ["ingest", "rg:products", "--size", "3"]], ids=["sql", "ingest"])
def test_a_store_path_that_is_no_folder_says_what_it_is(work, args):
    for store, says in _not_folders(work).items():
        before = _digest(work)
        line = assert_one_line_error(refinery(*args, "--store", store, cwd=work), f"store {store} ", says)
        assert "no such file" not in line.lower() and "is a folder" not in line
        assert _digest(work) == before


@pytest.mark.parametrize("store", ["S", "new"])
@pytest.mark.parametrize("home,says", [("afile", "PREFECT_HOME={work}/afile cannot be made"),
                                       ("afile/home", "PREFECT_HOME={work}/afile/home cannot be made")],
                         ids=["a-file", "under-a-file"])
def test_a_prefect_home_that_cannot_be_made_is_named(work, store, home, says):
    (work / "afile").write_text("a file")
    before = _digest(work)
    p = refinery("ingest", "rg:products", "--size", "3", "--store", store, cwd=work,
                 env={"PREFECT_HOME": str(work / home)})
    assert_one_line_error(p, says.format(work=work))
    assert _digest(work) == before  # S as it was, no store `new`


@pytest.mark.parametrize("store", ["S", "new"])
@pytest.mark.parametrize("url,says", [("not-a-url", "PREFECT_API_URL='not-a-url' is not the http(s) URL"),
                                      ("closed", "PREFECT_API_URL=http://127.0.0.1:{port}/api: no Prefect API answers")],
                         ids=["not-a-url", "closed-port"])
def test_a_prefect_api_that_cannot_be_reached_is_named(work, store, url, says):
    from flows.server.early_server import free_port

    port = free_port()  # free a moment ago: nothing listens there
    url = url if url != "closed" else f"http://127.0.0.1:{port}/api"
    before = _digest(work)
    p = refinery("ingest", "rg:products", "--size", "3", "--store", store, cwd=work, env={"PREFECT_API_URL": url})
    assert_one_line_error(p, says.format(port=port))
    assert "this looks like a bug" not in p.stderr and _digest(work) == before
