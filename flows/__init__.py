"""Prefect flows and the `refinery` command line.

A fresh ephemeral Prefect server migrates its SQLite database before it answers; on a busy 2-core machine that
has taken over Prefect's default 20 s, and the run then died before doing anything. Prefect reads its settings
once, when it is first imported, and importing the run config imports the task modules, which import Prefect,
so the longer wait is set here, before any of them, unless the environment sets it."""

import os

os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
