"""Write the golden stores kept under tests/data/golden/ (run from the repository root):

    .venv/bin/python tests/data/golden/make_stores.py [NAME ...]   # default: every run in tests/golden.py

Each is a small seeded curriculum run written by the code of the commit MANIFEST.json names for it, kept so that
tests/test_golden.py can check, after any change, that (1) the same seeded run writes the same rows in every
table and (2) a store written by older code still opens, answers the same SQL and resumes its run. Rerun this
only on purpose (a deliberate change of behaviour), and say so in the commit message. Naming runs rewrites
only those and keeps the others' stores and manifest entries: `resume` is worth keeping as old as it is, since
it stands for a store written by older code."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from golden import RUNS, SQL, answers, row_digest  # noqa: E402


def main() -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.chdir(ROOT)
    from prefect.testing.utilities import prefect_test_harness

    from flows.config import load_config
    from flows.curriculum import curriculum
    from storage.store import Store

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    names = sys.argv[1:] or list(RUNS)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        sys.exit(f"make_stores.py: unknown run {unknown[0]!r}; the runs are {', '.join(RUNS)}")
    old = json.loads((HERE / "MANIFEST.json").read_text()) if (HERE / "MANIFEST.json").exists() else {"runs": {}}
    manifest = {"runs": {n: {"commit": old.get("commit"), **e} for n, e in old["runs"].items() if n not in names}}
    with prefect_test_harness(server_startup_timeout=120):
        for name in names:
            spec = RUNS[name]
            root = HERE / name
            shutil.rmtree(root, ignore_errors=True)
            curriculum(load_config(sets=spec["sets"], run_id=name, store=str(root), rounds=spec["rounds"]))
            store = Store(root)
            # weights (MBs), pictures and empty lock files (named after this checkout): rows are kept
            for bulky in (".prefect", "_checkpoints", "_reports", ".locks", ".tmp"):
                shutil.rmtree(root / bulky, ignore_errors=True)
            manifest["runs"][name] = {"commit": commit, "digest": row_digest(store), "sql": answers(store, name)}
    manifest["sql"] = SQL
    (HERE / "MANIFEST.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
