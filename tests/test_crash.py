"""A writer SIGKILLed mid-commit leaves the store unchanged and readable, and the stage can land afterwards."""

import os
import signal
import time

import pytest
from conftest import kill_at_flag, run_python

from storage import query
from storage.store import Store

WRITER = """
import sys
from conftest import prompt_rows
from storage.store import Store
sys.path.insert(0, "tests")
Store(sys.argv[1] if len(sys.argv) > 1 else {root!r}).commit(
    "big", {{"prompts": prompt_rows(50_000, offset=1000), "pool": __import__("pyarrow").table(
        {{"run_id": ["r"], "round": [0], "prompt_id": ["p"], "status": ["active"]}})}}, run_id="r", round=0)
"""


def _snapshot(store: Store):
    return (
        query.sql(store, "SELECT count(*) AS n, sum(hash(prompt_id)) AS h FROM prompts").to_pylist(),
        query.sql(store, "SELECT count(*) AS n FROM pool").to_pylist(),
        store.landed("r", 0, "big"),
    )


@pytest.mark.parametrize("point", ["commit:written", "commit:renamed"])
def test_sigkill_mid_commit_leaves_store_unchanged(store, tmp_path, point):
    from conftest import prompt_rows

    store.commit("before", {"prompts": prompt_rows(100)})
    before = _snapshot(store)
    flag = tmp_path / "reached"
    code = "import sys; sys.path.insert(0, 'tests')\n" + WRITER.format(root=store.root)
    proc = run_python(code, env={"REFINERY_FAULT": point, "REFINERY_FAULT_FLAG": str(flag)})
    kill_at_flag(proc, flag, "the writer's fault point", timeout=120)

    # debris is on disk, but no reader sees it
    assert store.fs.glob(store.path(".tmp", "*"))
    assert _snapshot(store) == before
    removed = store.cleanup()
    assert removed and not store.fs.glob(store.path(".tmp", "*"))
    assert _snapshot(store) == before

    # the stage lands cleanly on the rerun
    rerun = run_python(code)
    assert rerun.wait(timeout=120) == 0
    counts, pool, landed = _snapshot(store)
    assert landed and counts[0]["n"] == 100 + 50_000 and pool == [{"n": 1}]


def test_cleanup_keeps_a_live_writers_temp_folder(store, tmp_path):
    flag = tmp_path / "reached"
    code = "import sys; sys.path.insert(0, 'tests')\n" + WRITER.format(root=store.root)
    proc = run_python(code, env={"REFINERY_FAULT": "commit:written", "REFINERY_FAULT_FLAG": str(flag)})
    try:
        deadline = time.time() + 120
        while not flag.exists():
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.05)
        assert store.cleanup() == []
        assert len(store.fs.glob(store.path(".tmp", "*"))) == 1
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
