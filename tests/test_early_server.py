"""`refinery run` starts Prefect's temporary server as it begins (flows/server/early_server.py): the flow's client takes
that very server, a server Prefect's settings do not want or that failed is stopped and Prefect starts its own
as before, a command that fails before its flow leaves neither a server nor a Prefect home behind, and nothing
starts where the environment names a server.

The server cases run in child interpreters with their own new PREFECT_HOME, so that the session's Prefect API
(tests/conftest.py) is neither used nor disturbed; each checks its children before its exit handlers run.
"""

import contextlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from test_cli_errors import assert_one_line_error, refinery

from flows.server.early_server import start_early

SERVER_APP = "prefect.server.api.server:create_app"
ROOT = Path(__file__).resolve().parents[1]


def servers_of(home: Path) -> list[int]:
    """PIDs of live Prefect server processes whose PREFECT_HOME is `home`."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if (p.status() != psutil.STATUS_ZOMBIE and SERVER_APP in p.cmdline()
                    and p.environ().get("PREFECT_HOME") == str(home)):
                found.append(p.pid)
    return found


def child_env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "REFINERY_"))}
    return env | {"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                  "PREFECT_LOGGING_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1"}


CHILDREN = """
import contextlib, os
from pathlib import Path
import psutil

def children():
    out = []
    for c in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if c.status() != psutil.STATUS_ZOMBIE:
                out.append(c.pid)
    return out
"""


def run_child(script: str, home: Path, *args: str) -> str:
    home.mkdir(parents=True, exist_ok=True)
    p = subprocess.run([sys.executable, "-c", CHILDREN + textwrap.dedent(script), *args], cwd=home.parent,
                       env=child_env(home), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert servers_of(home) == []  # stopped when the command ended
    return p.stdout


def test_the_flow_runs_on_the_server_started_early(tmp_path):
    out = run_child("""
        from flows.server.prefect_home import seed_database
        seed_database(Path(os.environ["PREFECT_HOME"]))
        from flows.server.early_server import start_early
        early = start_early()
        assert early is not None and children() == [early.process.pid]
        assert early.ready()
        from prefect.server.api.server import SubprocessASGIServer
        assert SubprocessASGIServer().server_process is early.process
        from prefect import flow
        @flow(name="noop")
        def noop():
            return 41 + 1
        assert noop() == 42
        assert SubprocessASGIServer().server_process is early.process
        assert children() == [early.process.pid]  # the flow's client started no server of its own
        assert start_early() is None  # a second run in this process: Prefect's server runs already
        print("ok")
    """, tmp_path / "home")
    assert "ok" in out


def test_cancel_stops_the_server_at_once(tmp_path):
    for wait in ("0", "4"):  # before the child could answer, and once uvicorn handles SIGTERM (it then waits)
        out = run_child("""
            import sys, time
            from flows.server.early_server import start_early
            early = start_early()
            time.sleep(float(sys.argv[1]))
            t = time.monotonic()
            early.cancel()
            took = time.monotonic() - t
            assert children() == [], children()
            assert took < 3, took
            print(f"cancelled in {took:.2f} s")
        """, tmp_path / f"home-{wait}", wait)
        assert "cancelled in" in out


@pytest.mark.slow  # two child runs; make test-slow
def test_a_server_the_settings_do_not_want_or_that_failed_is_dropped_for_prefects_own(tmp_path):
    """A profile (not the environment) names a server: the early child is stopped unused. A child that died:
    stopped, and the flow runs on the server Prefect starts itself, as without the early start."""
    home = tmp_path / "profile"
    home.mkdir()
    (home / "profiles.toml").write_text('active = "elsewhere"\n[profiles.elsewhere]\n'
                                        'PREFECT_API_URL = "http://127.0.0.1:9/api"\n')
    out = run_child("""
        from flows.server.early_server import start_early
        early = start_early()
        assert early is not None  # the environment names no server
        assert not early.ready()
        assert early.process.poll() is not None and children() == []
        print("unused")
    """, home)
    assert "unused" in out
    out = run_child("""
        from flows.server.prefect_home import seed_database
        seed_database(Path(os.environ["PREFECT_HOME"]))
        from flows.server.early_server import start_early
        early = start_early()
        early.process.kill()
        assert not early.ready()
        from prefect import flow
        @flow(name="noop")
        def noop():
            return 41 + 1
        assert noop() == 42
        from prefect.server.api.server import SubprocessASGIServer
        own = SubprocessASGIServer().server_process
        assert own is not None and own is not early.process and children() == [own.pid]
        print("fell back")
    """, tmp_path / "died")
    assert "fell back" in out


BAD_CONFIG = """
import argparse, sys
import flows.cli.commands as commands
import flows.server.early_server as early_server
import flows.server.prefect_setup as prefect_setup

for store, mode in zip(map(Path, sys.argv[1::2]), sys.argv[2::2]):  # one interpreter: the imports once
    started = []
    os.environ.pop("PREFECT_HOME", None)  # the last case's prepare_prefect set it; each store has its own home

    def spy():
        early = early_server.start_early()
        started.append(early)
        if mode == "foreign":  # someone else writes into the home this command made
            (store / ".prefect" / "theirs.txt").write_text("keep")
        return early

    prefect_setup.start_early = spy
    if mode == "first":  # a machine whose cache has no migrated Prefect database yet
        os.environ["REFINERY_CACHE"] = str(store.parent / "empty-cache")
    a = argparse.Namespace(store=str(store), verbose=False, config=None, set=["rollout.group_size=-3"],
                           run_id="x", rounds=None)
    try:
        commands.prepared_run(a)
    except ValueError as e:
        assert "group_size" in str(e), e
    else:
        raise AssertionError("the bad config was taken")
    if mode == "first":  # the config is checked first: nothing starts early, nothing is made
        assert started == [] and children() == [] and not store.exists()
    else:
        assert started and started[0] is not None, f"{mode}: no server was started early"
        assert started[0].process.poll() is not None and children() == []
    print("refused", mode)
"""


def test_a_bad_config_kills_the_server_and_undoes_only_what_it_made(tmp_path):
    """`prepared_run` with a bad config, the Prefect home in the store (no PREFECT_HOME). A new store: the
    server started early is killed and the store folder made for its home is gone. An existing store with data
    but no Prefect home: the data stays, the home goes. A file someone else put into the made home meanwhile:
    it stays, with its folders; only the seeded database goes. A machine's first run (no migrated database to
    copy): nothing starts early and nothing is made."""
    existing = tmp_path / "existing"
    (existing / "prompts").mkdir(parents=True)
    (existing / "prompts" / "part.parquet").write_bytes(b"data")
    (tmp_path / "empty-cache").mkdir()
    cases = {"new": tmp_path / "new", "existing": existing, "foreign": tmp_path / "foreign", "first": tmp_path / "first"}
    env = {k: v for k, v in child_env(tmp_path).items() if k != "PREFECT_HOME"}
    p = subprocess.run([sys.executable, "-c", CHILDREN + BAD_CONFIG, *sum(([str(v), k] for k, v in cases.items()), [])],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.split().count("refused") == 4, p.stderr[-3000:]
    assert all(servers_of((store / ".prefect").resolve()) == [] for store in cases.values())
    assert not (tmp_path / "new").exists()
    assert (existing / "prompts" / "part.parquet").read_bytes() == b"data" and not (existing / ".prefect").exists()
    assert sorted(p.name for p in (tmp_path / "foreign" / ".prefect").iterdir()) == ["theirs.txt"]
    assert not (tmp_path / "first").exists() and not any((tmp_path / "empty-cache").iterdir())


def test_a_bad_config_is_one_line_from_the_command(tmp_path):
    p = refinery("run", "--store", str(tmp_path / "new-store"), "--set", "rollout.group_size=-3", cwd=tmp_path,
                 env={"PREFECT_HOME": str(tmp_path / "new-store" / ".prefect")})
    assert_one_line_error(p, "group_size")
    assert not (tmp_path / "new-store").exists()


def test_nothing_starts_early_where_an_api_url_is_set(prefect_api, monkeypatch):
    assert start_early() is None  # the session's harness names its server in the settings, not the environment
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    assert start_early() is None


OTHER_COMMANDS = """
import sys
import flows.server.early_server as early_server
import flows.server.prefect_setup as prefect_setup
from flows.cli import main

started = []

def spy():
    early = early_server.start_early()
    started.append(early)
    return early

prefect_setup.start_early = spy
for case in sys.argv[1:]:  # one interpreter: the imports once
    store, *args = case.split("|")
    started.clear()
    os.environ.pop("PREFECT_HOME", None)  # each store has its own home, <store>/.prefect
    assert main([args[0], "--store", store, *args[1:]]) == 1, case
    assert started and started[0] is not None, f"{case}: no server was started early"
    assert started[0].process.poll() is not None and children() == [], f"{case}: the server outlived the refusal"
    print("refused", case, flush=True)
"""


def test_refused_input_of_other_commands_stops_before_any_flow(tmp_path):
    """eval, rescore and compare check their input while the early server starts (flows/server/prefect_setup.py
    `early_prefect`): the server was started, is killed by the refusal, and the refusal is one line per
    command. The Prefect home and database made for the server are gone again, as only a refusal before the
    flow leaves them (a flow that failed would have written its run into that database); a home folder that
    existed without a database (made by `refinery report`) stays, without the database seeded into it."""
    from flows.server.prefect_home import migrated_template, seed_database
    from storage.store import Store
    from tasks.ingest import ingest_source

    seed_database(tmp_path / "warm")  # this machine's migrated copy exists: the early start applies
    cache = migrated_template().parent
    plain, with_home = tmp_path / "store", tmp_path / "with-home"
    for root in (plain, with_home):
        ingest_source(Store(root), "rg:products", size=3, seed=0, params={"max_digits": 1})
    (with_home / ".prefect").mkdir()
    before = {root: sorted(p.name for p in root.iterdir()) for root in (plain, with_home)}
    cases = {f"{plain}|eval|--run-id|nope": "run 'nope' is not in the store",
             f"{plain}|eval": "has no runs of `refinery run`",
             f"{plain}|rescore|--run-id|nope": "run 'nope' is not in the store",
             f"{plain}|compare|--arms|uniform|--set|rollout.group_size=-3": "group_size",
             f"{with_home}|eval|--run-id|nope": "run 'nope' is not in the store"}
    env = {k: v for k, v in child_env(tmp_path).items() if k != "PREFECT_HOME"} | {"REFINERY_CACHE": str(cache)}
    p = subprocess.run([sys.executable, "-c", CHILDREN + OTHER_COMMANDS, *cases], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    refused = [ln.split(" ", 1)[1] for ln in p.stdout.splitlines() if ln.startswith("refused ")]
    assert p.returncode == 0 and refused == list(cases), (p.stdout, p.stderr[-3000:])
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("refinery: error: ")]
    assert "Traceback" not in p.stderr and len(errors) == len(cases), p.stderr[-3000:]
    assert all(needle in line for needle, line in zip(cases.values(), errors)), errors
    assert {root: sorted(p.name for p in root.iterdir()) for root in (plain, with_home)} == before
    assert list((with_home / ".prefect").iterdir()) == []
    assert all(servers_of((root / ".prefect").resolve()) == [] for root in (plain, with_home))
