"""Issue 47's probes, each as a careless or hostile user would type it: none prints a traceback or the "looks
like a bug" hint (that hint is for real bugs), a refused command is one line, and a command that fails leaves
the store as it found it (`store_digest`: every file's path and bytes, Prefect's own database and the empty
lock files aside) or, aimed at a store that does not exist, creates nothing.

Each probe runs the real `refinery` entry point in a subprocess on its own copy of one small store (20
ingested prompts and an imported run `r`). The behaviour behind each probe is tested where it lives
(test_import_identity.py, test_sql_output.py, test_ingest.py, test_cli_errors.py, ...); this module holds the
list in one place so that a new failure mode of any command shows up here as a bug hint or a changed store."""

import json
import os
import shutil
import subprocess

import pytest
from conftest import store_digest
from test_cli_errors import refinery

from storage.store import Store
from tasks.ingest import ingest_source
from tasks.interop.import_run import import_dump

BUG_HINT = "this looks like a bug"


def _dump(path, rewards=(1.0, 0.0, 1.0, 1.0)):
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "completion": f"\\boxed{{{2 * i}}}",
                                        "reward": r, "step": 1}) + "\n" for i, r in enumerate(rewards)))
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A small store: 20 ingested prompts and run `r` imported from dump A."""
    folder = tmp_path_factory.mktemp("probes")
    store = Store(folder / "store")
    ingest_source(store, "rg:products", size=20, seed=0, params={"max_digits": 1})
    import_dump(store, "plain", str(_dump(folder / "A.jsonl")), "r", tokenizer="tiny-random")
    return folder


def _files(tmp_path, base):
    """The probe's working folder: a copy of the base store (S), dump A and the inputs below."""
    shutil.copytree(base / "store", tmp_path / "S")
    shutil.copy(base / "A.jsonl", tmp_path / "A.jsonl")
    _dump(tmp_path / "B.jsonl", rewards=(0.0, 0.0, 1.0, 0.5))
    _dump(tmp_path / "edited.jsonl")
    (tmp_path / "allbad.jsonl").write_text('{"q": 1}\n{"question": ""}\n')
    (tmp_path / "bigint.jsonl").write_text(json.dumps({"question": "What is 1 + 1?", "answer": "2"}) + "\n"
                                           + '{"question": "x", "answer": "1", "meta": {"n": ' + "9" * 5000 + "}}\n")
    (tmp_path / "prompts.txt").write_text("What is 1 + 1?\n")
    (tmp_path / "huge.jsonl").write_text(json.dumps({"prompt": "q", "completion": "c", "reward": 1e308}) + "\n")
    (tmp_path / "notastore").mkdir()
    (tmp_path / "notastore" / "notes.txt").write_text("not a store")
    (tmp_path / "afile").write_text("a file")
    os.mkfifo(tmp_path / "fifo")
    os.symlink(tmp_path / "loop-b", tmp_path / "loop-a")
    os.symlink(tmp_path / "loop-a", tmp_path / "loop-b")


def _damage(tmp_path, how: str) -> None:
    """A landed prompts file of S replaced: by a link to a copy outside the store, by another table's rows, or
    by junk bytes."""
    part = next((tmp_path / "S" / "prompts").rglob("part-0.parquet"))
    if how == "symlink":
        shutil.move(part, tmp_path / "outside.parquet")
        os.symlink(tmp_path / "outside.parquet", part)
    elif how == "foreign":
        rollout = next((tmp_path / "S" / "rollouts").rglob("part-0.parquet"))
        shutil.copy(rollout, part)
    else:
        part.write_bytes(b"junk, not Parquet")


# (probe id, arguments, setup, expected exit code, what the one line says; None: exit 0)
FAILING = [
    ("import-other-dump", ["import", "plain", "B.jsonl", "--run-id", "r", "--tokenizer", "tiny-random"], None,
     "was imported from a different dump"),
    ("import-edited-dump", ["import", "plain", "A.jsonl", "--run-id", "r", "--tokenizer", "tiny-random"], "edit",
     "was imported from a different dump"),
    ("import-bad-tokenizer", ["import", "plain", "B.jsonl", "--run-id", "t", "--tokenizer", "/etc"], None,
     "--tokenizer /etc"),
    ("import-huge-reward", ["import", "plain", "huge.jsonl", "--run-id", "t"], None, "huge.jsonl line 1"),
    ("import-nan-correct-at", ["import", "plain", "A.jsonl", "--run-id", "t", "--correct-at", "nan"], None,
     "--correct-at nan"),
    ("import-reward-column-plain", ["import", "plain", "A.jsonl", "--run-id", "t", "--reward-column", "x"], None,
     "--reward-column x"),
    ("ingest-bigint", ["ingest", "bigint.jsonl"], None, "bigint.jsonl line 2: a number too long"),
    ("ingest-txt", ["ingest", "prompts.txt"], None, "unsupported file type '.txt'"),
    ("ingest-corrupt-part", ["ingest", "rg:products", "--size", "5", "--seed", "9"], "corrupt",
     "is not a readable Parquet file"),
    ("sql-symlinked-file", ["sql", "SELECT count(*) FROM prompts"], "symlink", "is a symbolic link"),
    ("sql-foreign-file", ["sql", "SELECT count(*) FROM prompts"], "foreign", "holds other columns"),
    ("sql-timeout", ["sql", "SELECT count(*) FROM range(300000) a, range(300000) b WHERE a.range + b.range = -1",
                     "--timeout", "1"], None, "query stopped after 1 s"),
    ("report-out-in-landed", ["report", "r", "--out", "S/_landed/rep"], None, "inside the store"),
]
# probes that name another store than S (S, when given, must stay as it was)
OTHER_STORES = [
    ("rejected-dump-missing-store", ["import", "plain", "huge.jsonl", "--run-id", "t", "--store", "new"], "new",
     "huge.jsonl line 1"),
    ("empty-store", ["sql", "SELECT 1", "--store", ""], None, "--store is empty"),
    ("not-a-store", ["sql", "SELECT 1", "--store", "notastore"], None, "is not a Refinery store"),
    ("memory-store", ["ingest", "rg:products", "--size", "3", "--store", "memory://x"], None, "memory://"),
    ("fifo-store", ["sql", "SELECT 1", "--store", "fifo"], None, "is a FIFO"),
    ("dev-null-store", ["sql", "SELECT 1", "--store", "/dev/null"], None, "is a character device"),
    ("loop-store", ["ingest", "rg:products", "--store", "loop-a"], "loop-a", "symbolic link loop"),
    ("file-store", ["sql", "SELECT 1", "--store", "afile"], None, "is a file, not a folder"),
]
ENVIRONMENT = [
    ("prefect-home-file", {"PREFECT_HOME": "afile"}, "PREFECT_HOME="),
    ("prefect-api-url-junk", {"PREFECT_API_URL": "not-a-url"}, "PREFECT_API_URL='not-a-url'"),
    ("prefect-api-url-closed", {"PREFECT_API_URL": "http://127.0.0.1:9/api"}, "no Prefect API answers there"),
]
SUCCEEDING = [
    ("sql-infinite-timestamp", ["sql", "SELECT 'infinity'::TIMESTAMP"]),
    ("sql-interval", ["sql", "SELECT max(created_at) - min(created_at) FROM prompts"]),
    ("sql-union", ["sql", "SELECT union_value(k := 1)"]),
    ("sql-self-join", ["sql", "SELECT a.prompt_id, b.prompt_id FROM prompts a JOIN prompts b USING (prompt_id)"]),
    ("sql-json-overflow", ["sql", "SELECT 1e308 * 10 AS r", "--format", "json"]),
    ("import-same-dump-other-path", ["import", "plain", "./A.jsonl", "--run-id", "r", "--tokenizer", "tiny-random"]),
]


def _clean(p: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in p.stderr and BUG_HINT not in p.stderr, p.stderr
    assert "panicked" not in p.stderr and "Warning" not in p.stderr, p.stderr


def _one_line(p: subprocess.CompletedProcess, needle: str) -> None:
    _clean(p)
    lines = p.stderr.splitlines()
    assert p.returncode == 1 and lines and lines[0].startswith("refinery: error: "), p.stderr
    assert len(lines) <= 2 and all(ln.startswith("hint: ") for ln in lines[1:]), p.stderr
    assert needle in lines[0], (needle, p.stderr)


@pytest.mark.parametrize("args,setup,needle", [p[1:] for p in FAILING], ids=[p[0] for p in FAILING])
def test_a_refused_command_is_one_line_and_leaves_the_store_as_it_was(base, tmp_path, args, setup, needle):
    _files(tmp_path, base)
    if setup == "edit":
        with open(tmp_path / "A.jsonl", "a") as f:
            f.write(json.dumps({"prompt": "new", "completion": "c", "reward": 1.0, "step": 1}) + "\n")
    elif setup:
        _damage(tmp_path, setup)
    before = store_digest(tmp_path / "S")
    _one_line(refinery(*args, "--store", "S", cwd=tmp_path), needle)
    assert store_digest(tmp_path / "S") == before


@pytest.mark.parametrize("args,made,needle", [p[1:] for p in OTHER_STORES], ids=[p[0] for p in OTHER_STORES])
def test_a_refused_store_argument_is_one_line_and_creates_nothing(base, tmp_path, args, made, needle):
    _files(tmp_path, base)
    before = sorted(os.listdir(tmp_path))
    _one_line(refinery(*args, cwd=tmp_path), needle)
    assert sorted(os.listdir(tmp_path)) == before  # no new store, no ./refinery-store, no .prefect
    if made and (tmp_path / made).exists() and not os.path.islink(tmp_path / made):
        assert not os.listdir(tmp_path / made)


@pytest.mark.parametrize("env,needle", [p[1:] for p in ENVIRONMENT], ids=[p[0] for p in ENVIRONMENT])
def test_a_prefect_setting_it_cannot_use_is_named(base, tmp_path, env, needle):
    _files(tmp_path, base)
    before = store_digest(tmp_path / "S")
    env = {k: str(tmp_path / v) if k == "PREFECT_HOME" else v for k, v in env.items()}
    _one_line(refinery("ingest", "rg:products", "--size", "3", "--seed", "5", "--store", "S", cwd=tmp_path, env=env),
              needle)
    assert store_digest(tmp_path / "S") == before


@pytest.mark.parametrize("args", [p[1] for p in SUCCEEDING], ids=[p[0] for p in SUCCEEDING])
def test_ordinary_input_that_used_to_crash_prints(base, tmp_path, args):
    _files(tmp_path, base)
    before = store_digest(tmp_path / "S")
    p = refinery(*args, "--store", "S", cwd=tmp_path)
    _clean(p)
    assert p.returncode == 0 and p.stdout, p.stderr
    assert store_digest(tmp_path / "S") == before
