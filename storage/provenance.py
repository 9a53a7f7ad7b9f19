"""Which code wrote a row: the git commit of this checkout and whether its code had uncommitted changes.

Every `runs` row records both (storage/runs.py), so a comparison can refuse runs made by different code
(flows/compare.py) and a page can name the one commit it describes. The commit is `git rev-parse HEAD` of the
checkout this package runs from; the tree counts as dirty when a tracked file or an untracked, not ignored one
under the code and its dependency lists (flows/, tasks/, storage/, models/, pyproject.toml, requirements/,
constraints-cpu.txt) differs from HEAD: docs, benchmarks' outputs and notes do not change what a run does.
Outside a git checkout (an installed wheel) the commit is `curriculum-refinery <version>` and dirtiness is
unknown (None). Asked once per process.
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CODE = ("flows", "tasks", "storage", "models", "pyproject.toml", "requirements", "constraints-cpu.txt")


def code_version() -> tuple[str, bool | None]:
    """(commit, dirty) of the code this process runs (module docstring). $REFINERY_CODE_VERSION, when set, is
    the commit instead, clean: for a deployment image built without its git metadata, and for tests that need
    runs of one (or of two) known commits."""
    pinned = os.environ.get("REFINERY_CODE_VERSION", "").strip()
    return (pinned, False) if pinned else _git_version()


@functools.cache
def _git_version() -> tuple[str, bool | None]:
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()
        status = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", *CODE], capture_output=True,
                                text=True, check=True, timeout=30).stdout
        return head, bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"curriculum-refinery {version('curriculum-refinery')}", None
        except PackageNotFoundError:
            return "unknown", None
