"""Where Prefect keeps its home (profiles, SQLite database, serve's logs) for a store: one rule for every
command and for `refinery serve`, so that a served store and a CLI run against it share one database.

$PREFECT_HOME when set, else `<store>/.prefect` for a local store, else `./.prefect` for a remote one (a bucket
cannot hold a SQLite database).
"""

from __future__ import annotations

import os
from pathlib import Path


def prefect_home(store: str) -> Path:
    """$PREFECT_HOME, else <store>/.prefect for a local store (./.prefect for a remote one)."""
    if os.environ.get("PREFECT_HOME"):
        return Path(os.environ["PREFECT_HOME"]).expanduser().resolve()
    local = "://" not in store or store.startswith("file://")
    return ((Path(store.removeprefix("file://")) if local else Path.cwd()) / ".prefect").resolve()
