"""Where Prefect keeps its home (profiles, SQLite database, serve's logs) for a store: one rule for every
command and for `refinery serve`, so that a served store and a CLI run against it share one database.

$PREFECT_HOME when set, else `<store>/.prefect` for a local store, else `./.prefect` for a remote one (a bucket
cannot hold a SQLite database).

A fresh home starts from a migrated empty database (`seed_database`): Prefect's server otherwise runs every one
of its migrations on a new SQLite file before it answers, about 15 s of a fresh store's first run on 2 cores
(27 s to the first flow run against 14 s from a migrated file). The migrated file is made once per machine and
Prefect version, by Prefect's own `create_db` in a child process (so this process does not import Prefect's
server), kept in the Refinery cache as `prefect-<version>.db`, and copied into each fresh home. Choices:
- only where this process would start Prefect's ephemeral server on the home's default database: not when
  $PREFECT_API_URL names a server, not when a database URL is configured, not when the home has a database;
- nothing is half-written: the cached file and the home's copy are each written under a temporary name and
  moved into place, and a copy never replaces a database already there (two commands seeding one home at once);
- it only saves time: if the migrated file cannot be made or read, the home is left as it was and Prefect
  migrates it, as it would have anyway (the reason is logged).
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

log = logging.getLogger("refinery.prefect")

DATABASE = "prefect.db"  # Prefect's default SQLite file in its home
DATABASE_URL_SETTINGS = ("PREFECT_API_DATABASE_CONNECTION_URL", "PREFECT_SERVER_DATABASE_CONNECTION_URL")
CREATE_DB = ("import asyncio\nfrom prefect.server.database import provide_database_interface\n"
             "asyncio.run(provide_database_interface().create_db())")
BUILD_TIMEOUT_S = 600


def prefect_home(store: str) -> Path:
    """$PREFECT_HOME, else <store>/.prefect for a local store (./.prefect for a remote one)."""
    if os.environ.get("PREFECT_HOME"):
        return Path(os.environ["PREFECT_HOME"]).expanduser().resolve()
    local = "://" not in store or store.startswith("file://")
    return ((Path(store.removeprefix("file://")) if local else Path.cwd()) / ".prefect").resolve()


def migrated_template(cache: Path | None = None) -> Path:
    """The cached migrated empty database for the installed Prefect (its path; it may not exist yet)."""
    if cache is None:
        from models.cache import cache_root

        cache = cache_root()
    return cache / f"prefect-{version('prefect')}.db"


def schema_version(db: Path) -> str:
    """The Alembic revision a Prefect database is migrated to; ValueError names a file that is not one."""
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            rows = con.execute("SELECT version_num FROM alembic_version").fetchall()
        finally:
            con.close()
    except sqlite3.Error as e:
        raise ValueError(f"{db} is not a migrated Prefect database: {e}") from None
    if len(rows) != 1:
        raise ValueError(f"{db} is not a migrated Prefect database: {len(rows)} rows in alembic_version")
    return rows[0][0]


def build_template(template: Path) -> Path:
    """Migrate a new empty database with Prefect's `create_db` in a child process and keep it at `template`."""
    template.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=template.parent, prefix=".prefect-home-") as home:
        env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", *DATABASE_URL_SETTINGS)}
        env |= {"PREFECT_HOME": home, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        proc = subprocess.run([sys.executable, "-c", CREATE_DB], env=env, capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"Prefect's create_db failed: {last}")
        migrated = Path(home) / DATABASE
        schema_version(migrated)
        partial = template.with_name(f".{template.name}.{os.getpid()}.tmp")
        src, dst = sqlite3.connect(migrated), sqlite3.connect(partial)
        try:
            src.backup(dst)  # one self-contained file: the migration's pages may still sit in the WAL
            dst.execute("PRAGMA journal_mode=DELETE")  # reading it then leaves no -wal/-shm files beside it
        finally:
            dst.close()
            src.close()
        os.replace(partial, template)
    return template


def api_url_in_settings() -> str | None:
    """The API URL of Prefect's settings where Prefect is imported already (a test harness, an embedding
    program): it may name a server without the environment saying so. Not imported: the environment decides."""
    if "prefect.settings" not in sys.modules:
        return None
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def seed_database(home: Path, cache: Path | None = None) -> str:
    """Copy the migrated empty database into `home` where this process's ephemeral Prefect server would
    otherwise migrate a new one; returns what was done, in words."""
    if os.environ.get("PREFECT_API_URL") or api_url_in_settings():
        return "skipped: PREFECT_API_URL names a server"
    if any(os.environ.get(k) for k in DATABASE_URL_SETTINGS):
        return "skipped: a database URL is configured"
    target = home / DATABASE
    if target.exists():
        return "skipped: the home has a database"
    template = migrated_template(cache)
    try:
        try:
            schema_version(template)
        except ValueError:
            log.info("migrating Prefect's empty database once for this machine (%s)", template)
            build_template(template)
        partial = home / f".{DATABASE}.{os.getpid()}.tmp"
        shutil.copyfile(template, partial)
        try:
            os.link(partial, target)  # never replaces a database another command put there meanwhile
        except FileExistsError:
            return "skipped: the home has a database"
        finally:
            partial.unlink()
    except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
        log.warning("Prefect's database is migrated in place instead of copied: %s", e)
        return f"skipped: {e}"
    return f"seeded from {template}"


def seeding_is_cheap(home: Path) -> bool:
    """Would `seed_database(home)` be a file copy at most (the home has a database, or this machine's migrated
    copy exists), not Prefect's migrations run once for the machine (about 15 s)?"""
    if (home / DATABASE).exists():
        return True
    try:
        schema_version(migrated_template())
    except ValueError:
        return False
    return True


def missing_folders(path: Path) -> list[Path]:
    """The folders that making `path` would create, innermost first (empty if it exists)."""
    missing = []
    for p in (path, *path.parents):
        if p.exists():
            break
        missing.append(p)
    return missing


def file_identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of a file, or None if there is none: which file a name held at one moment."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def remove_made(made: list[Path], database: Path, seeded: tuple[int, int] | None) -> None:
    """Undo a home this command made and seeded, touching nothing anyone else wrote: the database only if it is
    still the file seeded (`seeded`, from `file_identity`), with SQLite's side files; then each folder of `made`
    (innermost first) only while it is empty."""
    if seeded is not None and file_identity(database) == seeded:
        for name in (database.name, f"{database.name}-wal", f"{database.name}-shm", f"{database.name}-journal"):
            (database.parent / name).unlink(missing_ok=True)
    for folder in made:
        try:
            folder.rmdir()
        except OSError:  # not empty: something else lives there now
            break
