"""Write the golden stores kept under tests/data/golden/ (run from the repository root):

    .venv/bin/python tests/data/golden/make_stores.py [NAME ...]   # default: every run in tests/golden.py
    .venv/bin/python tests/data/golden/make_stores.py --scrub      # only `scrub` the stores kept here

Each is a small seeded curriculum run written by the code of the commit MANIFEST.json names for it, kept so that
tests/test_golden.py can check, after any change, that (1) the same seeded run writes the same rows in every
table and (2) a store written by older code still opens, answers the same SQL and resumes its run. Rerun this
only on purpose (a deliberate change of behaviour), and say so in the commit message. Naming runs rewrites
only those and keeps the others' stores and manifest entries: `resume` is worth keeping as old as it is, since
it stands for a store written by older code.

The stores hold no path of the machine that wrote them (`scrub`, tests/test_golden.py checks): a run's config
keeps no `store` (code before 8e8638f recorded it), a checkpoint row names a store-relative folder or a built-in
model (`default`, `tiny-random`) rather than this checkout or this machine's model cache. Those are the columns
the golden comparison leaves out (tests/golden.py `VOLATILE`), so the digests stay as they were. (A teacher is
named by its weights since a140e90, models/registry.py `model_identity`: the code writes no path there.)"""

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


def scrub(root: Path) -> int:
    """Rewrite `root`'s runs and checkpoints files without the writer's paths (see above); the files changed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from models.cache import BUILT_IN, model_identity

    own = str(root.resolve() / "_checkpoints") + "/"

    def path(value: str) -> str:
        if value.startswith(own):
            return value.replace(own, "_checkpoints/", 1)
        return model_identity(value) if model_identity(value) in BUILT_IN else value

    def config(value: str) -> str:
        return json.dumps({k: v for k, v in json.loads(value).items() if k != "store"})

    changed = 0
    for table, column, fix in (("runs", "config", config), ("checkpoints", "path", path)):
        for file in sorted((root / table).rglob("*.parquet")):
            data = pq.read_table(file)
            old = data[column].to_pylist()
            new = [fix(v) if v is not None else v for v in old]
            if new != old:
                data = data.set_column(data.schema.get_field_index(column), data.schema.field(column),
                                       pa.array(new, data.schema.field(column).type))
                pq.write_table(data, file)
                changed += 1
    return changed


def main() -> None:
    if sys.argv[1:] == ["--scrub"]:
        for name in RUNS:
            print(f"{name}: {scrub(HERE / name)} files rewritten")
        return
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
            scrub(root)
            manifest["runs"][name] = {"commit": commit, "digest": row_digest(store), "sql": answers(store, name)}
    manifest["sql"] = SQL
    (HERE / "MANIFEST.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
