"""Every CLI error is one line (`refinery: error: ...`, plus at most one `hint: ...`), exits non-zero, and
shows a traceback only with --debug or REFINERY_DEBUG=1.

Most cases run the real `refinery` entry point as a subprocess, so that what is checked is exactly what a
user's terminal shows (stderr whole, Prefect's own logging included). The cases that need a Prefect flow
share the session's Prefect API through PREFECT_API_URL instead of each starting their own server.
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from storage.schemas import TABLES, NotFound
from storage.store import Store
from tasks.ingest import ingest_source

REFINERY = Path(sys.executable).with_name("refinery")


def refinery(*args: str, cwd: Path, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    # not what an in-process `main` of an earlier test left in os.environ (prepare_prefect's console settings)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("REFINERY_", "PREFECT_API_URL",
                                                                      "PREFECT_LOGGING_HANDLERS_CONSOLE",
                                                                      "HF_HUB_DISABLE_PROGRESS_BARS"))}
    cmd = [str(REFINERY)] if REFINERY.exists() else [sys.executable, "-m", "flows.cli"]
    return subprocess.run([*cmd, *args], cwd=cwd, env={**base, "HF_HUB_OFFLINE": "1", **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(p: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 1, stderr = one `refinery: error:` line (plus at most one `hint:` line) holding every needle."""
    lines = p.stderr.splitlines()
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr and len(lines) in (1, 2), p.stderr
    assert lines[0].startswith("refinery: error: "), p.stderr
    assert len(lines) == 1 or lines[1].startswith("hint: "), p.stderr
    for needle in needles:
        assert needle in lines[0], (needle, p.stderr)
    return lines[0]


@pytest.fixture(scope="module")
def small_store(tmp_path_factory) -> Store:
    store = Store(tmp_path_factory.mktemp("cli-errors") / "store")
    ingest_source(store, "rg:products", size=5, seed=0, params={"max_digits": 1})
    return store


@pytest.fixture
def api_env(prefect_api) -> dict:
    """The session's Prefect API, for subprocesses that run a flow."""
    from prefect.settings import PREFECT_API_URL

    return {"PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_HOME": os.environ["PREFECT_HOME"]}


@pytest.mark.parametrize("content", ["", "\n  \n\t\n"], ids=["empty", "blank-only"])
def test_ingest_of_a_file_with_no_rows(tmp_path, content):
    (tmp_path / "prompts.jsonl").write_text(content)
    p = refinery("ingest", "prompts.jsonl", "--store", "store", cwd=tmp_path)
    assert_one_line_error(p, "prompts.jsonl: no rows")
    assert not (tmp_path / "store").exists()  # refused before Prefect (and its home inside the store) started


@pytest.mark.parametrize("query,needle", [
    ("SELECT anser FROM prompts", "anser"),                    # a column typo
    ("SELECT count(*) FROM prompt", "prompt"),                 # a table typo
    ("SELECT no_such_function(answer) FROM prompts", "no_such_function"),
], ids=["column", "table", "function"])
def test_sql_typos_are_one_line(small_store, tmp_path, query, needle):
    line = assert_one_line_error(refinery("sql", query, "--store", small_store.root, cwd=tmp_path), needle)
    assert "LINE 1" not in line and "^" not in line  # the caret art pointing into the query is dropped


def test_config_pointing_at_a_folder(tmp_path):
    p = refinery("run", "--config", str(tmp_path), "--store", "store", cwd=tmp_path)
    assert_one_line_error(p, f"config file '{tmp_path}' is a folder")
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("args", [["--config", "."], ["--set", "model.policy=some-org/some-model"]],
                         ids=["config-folder", "offline-hub-id"])
def test_a_refused_run_on_a_machine_without_prefect_s_migrated_database(tmp_path, args):
    """On a machine's first run (no migrated Prefect database in the cache yet) the command checks its input
    before making Prefect's home; Prefect's import, which tries to make that home and cannot (the store does
    not exist), used to add its warning to the error line. Earlier tests in the same worker had made the
    cache, so the test's outcome depended on the order the tests ran in; here the cache is empty on purpose."""
    p = refinery("run", *args, "--store", "store", cwd=tmp_path, env={"REFINERY_CACHE": str(tmp_path / "cache")})
    assert_one_line_error(p)
    assert not (tmp_path / "store").exists()


def test_store_that_is_a_file(tmp_path):
    (tmp_path / "afile").write_text("not a store")
    for args in (["sql", "SELECT 1"], ["ingest", "rg:products"], ["run"]):
        p = refinery(*args, cwd=tmp_path, env={"REFINERY_STORE": str(tmp_path / "afile")})
        assert_one_line_error(p, f"store {tmp_path / 'afile'} (from $REFINERY_STORE) is a file, not a folder")
    assert (tmp_path / "afile").read_text() == "not a store"


def test_hugging_face_id_while_offline(tmp_path):
    p = refinery("run", "--set", "model.policy=some-org/some-model", "--store", "store", cwd=tmp_path)
    assert_one_line_error(p, "model.policy: 'some-org/some-model' is a Hugging Face id that is not in the local "
                             "cache, and HF_HUB_OFFLINE is set")
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("args", [["sql", "SELECT count(*) FROM prompts"], ["lineage", "abc123"],
                                  ["report", "some-run"], ["eval"], ["catalog"], ["rescore"]],
                         ids=lambda a: a[0])
def test_read_commands_on_a_store_that_does_not_exist(tmp_path, args):
    p = refinery(*args, "--store", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert_one_line_error(p, f"store {tmp_path / 'nowhere'} does not exist")
    assert p.stdout == "" and not (tmp_path / "nowhere").exists()  # no zero-row table, nothing created


def test_bad_command_line_is_one_line_with_a_hint(tmp_path):
    p = refinery("run", "--rounds", "many", cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.splitlines() == [
        "refinery: error: argument --rounds: invalid int value: 'many'", "hint: refinery run --help"]


def test_traceback_only_with_debug(small_store, tmp_path):
    query = ["sql", "SELECT anser FROM prompts", "--store", small_store.root]
    assert_one_line_error(refinery(*query, cwd=tmp_path))
    for p in (refinery(*query, "--debug", cwd=tmp_path), refinery("--debug", *query, cwd=tmp_path),
              refinery(*query, cwd=tmp_path, env={"REFINERY_DEBUG": "1"})):
        assert p.returncode == 1 and p.stderr.startswith("Traceback (most recent call last):"), p.stderr
        assert p.stderr.splitlines()[-1].startswith("refinery: error: ") and "anser" in p.stderr.splitlines()[-1]


def test_failure_inside_a_flow_is_one_line_without_prefect_logs(api_env, tmp_path):
    """The source passes the CLI's pre-checks (a file's rows included); the ingest flow fails on the store, whose
    landed prompts file is junk. Prefect logs that failure at ERROR with a traceback (twice): without -v none of
    it reaches the terminal."""
    ingest_source(Store(tmp_path / "store"), "rg:products", size=3, seed=0)
    next((tmp_path / "store" / "prompts").rglob("*.parquet")).write_bytes(b"junk, not Parquet")
    p = refinery("ingest", "rg:products", "--size", "3", "--seed", "1", "--store", "store", cwd=tmp_path, env=api_env)
    assert_one_line_error(p, "is not a readable Parquet file")
    loud = refinery("ingest", "rg:products", "--size", "3", "--seed", "1", "--store", "store", "-v", cwd=tmp_path,
                    env=api_env)
    assert loud.returncode == 1 and "Traceback" in loud.stderr  # -v: Prefect's log, traceback and all


def test_end_of_run_hint_is_shell_quoted():
    from flows.cli import try_command

    store = "/tmp/my store/it's here; rm -rf x"
    argv = shlex.split(try_command(store, "run-1"))
    assert argv == ["refinery", "sql", "--store", store, "SELECT round, bucket, count(*) FROM prompt_scores "
                    "WHERE run_id = 'run-1' GROUP BY ALL ORDER BY ALL"]



def test_a_long_multi_line_message_stays_one_readable_line():
    from flows.cli.errors import MAX_PARTS, one_line
    from tasks.core.sources import BadRow
    from tasks.ingest import IngestRejected

    rejected = IngestRejected("big.jsonl", [BadRow("big.jsonl", i, "field 'answer' is missing") for i in range(1, 11)])
    line = one_line(rejected)
    assert "\n" not in line and line.startswith("big.jsonl: rejected, 10 bad row(s), nothing written: big.jsonl line 1:")
    assert line.count("field 'answer' is missing") == MAX_PARTS - 1 and line.endswith(f"(and {11 - MAX_PARTS} more)")
    assert one_line(RuntimeError("")) == "RuntimeError" and one_line(NotFound("no such table")) == "no such table"
    assert one_line(KeyError("choices")) == "KeyError: 'choices'"  # a plain KeyError is a slip, not user input


@pytest.mark.parametrize("args, needle", [
    (["lineage", "zzz"], "no prompt with id 'zzz' in the store"),
    (["sql", "SELECT 1"], f"unknown table 'nope'; the store's tables are: {', '.join(TABLES)}")],
    ids=["prompt", "table"])
def test_deliberate_not_found_errors_are_one_line_without_a_bug_hint(small_store, tmp_path, capsys, monkeypatch,
                                                                    args, needle):
    """Unknown prompt (real `refinery lineage`) and unknown table (storage's own check): the user's input,
    so one line, no type name, no "looks like a bug" hint."""
    import flows.cli.parser
    from storage.store import Store

    if args[0] == "sql":  # the deliberate raise site in Store.files, reached as a command would reach it
        monkeypatch.setattr(flows.cli.parser, "cmd_sql", lambda a: Store(a.store).files("nope"))
    assert flows.cli.parser.main([*args, "--store", small_store.root]) == 1
    assert capsys.readouterr().err.splitlines() == [f"refinery: error: {needle}"]


def test_a_bare_key_error_is_reported_as_a_bug(small_store, capsys, monkeypatch):
    """`data["choices"]` on a malformed answer is a programming slip: type name, quotes, and the bug hint."""
    import flows.cli.parser

    def slip(a):
        return {}["choices"]

    monkeypatch.setattr(flows.cli.parser, "cmd_lineage", slip)
    assert flows.cli.parser.main(["lineage", "x", "--store", small_store.root]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "refinery: error: KeyError: 'choices'",
        "hint: this looks like a bug: rerun with --debug (or REFINERY_DEBUG=1) for the traceback"]


def test_the_ephemeral_servers_startup_wait_reaches_prefect_although_the_config_imports_it_first():
    """`refinery run` imports the run config (and with it Prefect) before it sets up Prefect's home; Prefect
    reads its settings on import, so a wait set after that never applied: a fresh store's first run died after
    Prefect's default 20 s while its server migrated. The default now comes with the `flows` package."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"}
    code = ("import sys, flows.config; assert 'prefect' in sys.modules; "
            "from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS as s; print(s.value())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["180"]
