"""A fresh Prefect home starts from the cached migrated database (flows/server/prefect_home.py seed_database): copied
only where this process's ephemeral server would migrate a new file, never over a database, never half-written;
a template that cannot be made leaves the home to Prefect's own migration."""

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

import flows.server.prefect_home as ph
from flows.server.prefect_home import DATABASE, migrated_template, schema_version, seed_database


@pytest.fixture
def no_server(monkeypatch):
    """As a plain `refinery run`: no API URL, no database URL (the session's Prefect API, when this worker
    started it, names one in Prefect's settings: the last test covers that)."""
    for k in ("PREFECT_API_URL", *ph.DATABASE_URL_SETTINGS):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(ph, "api_url_in_settings", lambda: None)


def _database(path: Path, revision: str) -> Path:
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
    con.execute("INSERT INTO alembic_version VALUES (?)", (revision,))
    con.commit()
    con.close()
    return path


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_a_fresh_home_gets_a_copy_of_the_cached_template(tmp_path, no_server):
    cache, home = tmp_path / "cache", tmp_path / "home"
    cache.mkdir()
    home.mkdir()
    _database(migrated_template(cache), "rev-a")
    assert seed_database(home, cache) == f"seeded from {migrated_template(cache)}"
    assert schema_version(home / DATABASE) == "rev-a"
    assert _leftovers(home) == []
    assert seed_database(home, cache) == "skipped: the home has a database"


def test_a_database_already_there_is_never_replaced(tmp_path, no_server, monkeypatch):
    cache, home = tmp_path / "cache", tmp_path / "home"
    cache.mkdir()
    home.mkdir()
    _database(migrated_template(cache), "rev-a")
    _database(home / DATABASE, "rev-old")
    assert seed_database(home, cache) == "skipped: the home has a database"
    assert schema_version(home / DATABASE) == "rev-old"

    # another command seeds the same home between this one's copy and its move into place
    (home / DATABASE).unlink()
    real = ph.shutil.copyfile

    def racing(src, dst):
        real(src, dst)
        _database(home / DATABASE, "rev-other")

    monkeypatch.setattr(ph.shutil, "copyfile", racing)
    assert seed_database(home, cache) == "skipped: the home has a database"
    assert schema_version(home / DATABASE) == "rev-other"
    assert _leftovers(home) == []


@pytest.mark.parametrize("setting", ["PREFECT_API_URL", "PREFECT_API_DATABASE_CONNECTION_URL",
                                     "PREFECT_SERVER_DATABASE_CONNECTION_URL"])
def test_a_named_server_or_database_leaves_the_home_alone(tmp_path, no_server, monkeypatch, setting):
    cache, home = tmp_path / "cache", tmp_path / "home"
    cache.mkdir()
    home.mkdir()
    _database(migrated_template(cache), "rev-a")
    monkeypatch.setenv(setting, "http://127.0.0.1:9/api" if setting == "PREFECT_API_URL" else
                       "postgresql+asyncpg://u:p@127.0.0.1:9/prefect")
    assert seed_database(home, cache).startswith("skipped: ")
    assert list(home.iterdir()) == []


def test_a_broken_template_is_rebuilt_and_a_failed_build_changes_nothing(tmp_path, no_server, monkeypatch):
    """A cached file that is not a migrated database is made again; when that fails (here Prefect's create_db
    replaced by a script that fails), the reason is returned in one line and the home stays empty, the junk
    template untouched."""
    cache, home = tmp_path / "cache", tmp_path / "home"
    cache.mkdir()
    home.mkdir()
    migrated_template(cache).write_bytes(b"not a database")
    monkeypatch.setattr(ph, "CREATE_DB", "raise SystemExit('no migrations here')")
    out = seed_database(home, cache)
    assert out == "skipped: Prefect's create_db failed: no migrations here"
    assert list(home.iterdir()) == []
    assert migrated_template(cache).read_bytes() == b"not a database"
    assert _leftovers(cache) == [] and sorted(p.name for p in cache.iterdir()) == [migrated_template(cache).name]


@pytest.mark.slow
def test_the_template_is_prefects_migration_and_a_server_runs_on_its_copy(tmp_path, no_server):
    """The real build (Prefect's create_db in a child process), then a flow run on an ephemeral server over the
    seeded home: the run completes and the server found nothing to migrate (the revision is unchanged)."""
    cache, home = tmp_path / "cache", tmp_path / "home"
    home.mkdir(parents=True)
    assert seed_database(home, cache) == f"seeded from {migrated_template(cache)}"
    revision = schema_version(home / DATABASE)
    assert revision == schema_version(migrated_template(cache))
    assert not (cache / f"{migrated_template(cache).name}-wal").exists()  # the template is not left in WAL mode
    code = "from prefect import flow\n@flow\ndef noop():\n    return 41 + 1\nprint(noop())"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "42"
    assert schema_version(home / DATABASE) == revision
    con = sqlite3.connect(home / DATABASE)
    assert con.execute("SELECT count(*) FROM flow_run").fetchall() == [(1,)]
    con.close()


def test_a_server_named_in_prefects_settings_leaves_the_home_alone(tmp_path, monkeypatch, prefect_api):
    """The session's API is set in Prefect's settings, not the environment (as an in-process command runs)."""
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    cache, home = tmp_path / "cache", tmp_path / "home"
    cache.mkdir()
    home.mkdir()
    _database(migrated_template(cache), "rev-a")
    assert seed_database(home, cache) == "skipped: PREFECT_API_URL names a server"
    assert list(home.iterdir()) == []
