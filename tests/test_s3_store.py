"""The store on an S3 protocol server (moto's, on 127.0.0.1): ingest, a curriculum run killed mid-collect and
resumed, SQL, lineage and the report, with the endpoint and credentials from the standard AWS variables.

S3 has no rename: a commit writes its parts in place under `attempt=<uuid>` and PUTs the commit record last
(storage/store.py), so a killed commit leaves files no reader lists, and cleanup removes them."""

import json
import os
import signal
import sys
import time
import uuid

import pytest
from conftest import ROOT, kill_at_flag, run_cli, run_python
from test_eval_dataset import SETS as SCRIPTED

from storage.query import sql
from storage.store import Store

pytest.importorskip("s3fs")
pytest.importorskip("moto")
SETS = [s for s in SCRIPTED if s != "train.enabled=false"]


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 and a fresh bucket; the AWS variables point at it for this module."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    bucket = f"refinery-{uuid.uuid4().hex[:12]}"  # hosts cache fetched checkpoints by store name: a fresh one
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    try:
        yield client, bucket
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def _keys(client, bucket: str, prefix: str) -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def test_ingest_sql_and_lineage_on_s3(prefect_api, s3):
    client, bucket = s3
    root = f"s3://{bucket}/ingest"
    code, out, err = run_cli("ingest", "rg:products", "--size", "6", "--seed", "1", "--store", root)
    assert code == 0, err
    assert "6 new prompts landed" in out
    keys = _keys(client, bucket, "ingest/")
    parts = [k for k in keys if k.startswith("ingest/prompts/")]
    assert parts and all("/attempt=" in k and k.endswith(".parquet") for k in parts)
    assert not [k for k in keys if k.startswith("ingest/.tmp/")]  # the claim goes once the record is written
    (row,) = sql(Store(root), "SELECT count(*) AS n, min(prompt_id) AS p FROM prompts").to_pylist()
    assert row["n"] == 6
    code, out, err = run_cli("lineage", row["p"], "--json", "--store", root)
    assert code == 0 and json.loads(out)["prompt"]["prompt_id"] == row["p"], err


RUN = """
import sys
sys.path.insert(0, "tests")
from flows.config import load_config
from flows.curriculum import curriculum
from test_s3_store import SETS
curriculum(load_config(sets=SETS, run_id="s3run", store=sys.argv[1], rounds=1))
"""


@pytest.mark.slow
def test_a_run_killed_mid_collect_resumes_on_s3_with_the_rows_of_an_uninterrupted_one(prefect_api, s3, tmp_path):
    from prefect.settings import PREFECT_API_URL

    client, bucket = s3
    root = f"s3://{bucket}/runs"
    flag = tmp_path / "reached"
    env = {"PREFECT_API_URL": PREFECT_API_URL.value() or "", "REFINERY_FAULT": "collect:mid",
           "REFINERY_FAULT_FLAG": str(flag)}
    proc = run_python(RUN.replace("sys.argv[1]", repr(root)), env=env)
    kill_at_flag(proc, flag, "collect:mid")
    store = Store(root)
    assert store.landed("s3run", 0, "select") and not store.landed("s3run", 0, "collect")

    code, out, err = run_cli("run", "--run-id", "s3run", "--rounds", "1", "--store", root,
                             *[x for s in SETS for x in ("--set", s)])
    assert code == 0, err
    local = Store(tmp_path / "local")
    code, _, err = run_cli("run", "--run-id", "s3run", "--rounds", "1", "--store", local.root,
                           *[x for s in SETS for x in ("--set", s)])
    assert code == 0, err
    for q in ("SELECT round, prompt_id, sample_idx, completion, reward FROM rollouts ORDER BY ALL",
              "SELECT round, stage, purpose, calls, completions, tokens FROM generated_tokens ORDER BY ALL",
              "SELECT policy_version, split, prompt_id, n_samples, n_correct FROM eval_results ORDER BY ALL"):
        assert sql(store, q) == sql(local, q), q
    statuses = sql(store, "SELECT status FROM runs WHERE run_id = 's3run' ORDER BY created_at").to_pylist()
    assert [s["status"] for s in statuses] == ["running", "failed", "resumed", "completed"]
    code, out, err = run_cli("report", "s3run", "--out", str(tmp_path / "report"), "--store", root)
    assert code == 0 and (tmp_path / "report" / "index.html").exists(), err

    # another host continues the run: checkpoints are recorded in the bucket, fetched into its own cache
    import shutil

    from models.checkpoints import checkpoint_root

    (path,) = sql(store, "SELECT path FROM checkpoints WHERE policy_version = 1").column("path").to_pylist()
    assert path == f"{root}/_checkpoints/run_id=s3run/v1"
    assert "runs/_checkpoints/run_id=s3run/v1/config.json" in _keys(client, bucket, "runs/_checkpoints/")
    shutil.rmtree(checkpoint_root(store))  # nothing of the first host's cache is left
    code, out, err = run_cli("run", "--run-id", "s3run", "--rounds", "2", "--store", root,
                             *[x for s in SETS for x in ("--set", s)])
    assert code == 0, err
    (evaluated,) = sql(store, "SELECT max(policy_version) AS v FROM evals").column("v").to_pylist()
    assert evaluated == 2 and (checkpoint_root(store) / "run_id=s3run" / "v1" / "config.json").is_file()


def test_a_commit_killed_before_its_record_is_invisible_and_cleaned_up(s3, tmp_path):
    client, bucket = s3
    root = f"s3://{bucket}/faults"
    code = f"""
import pyarrow as pa
from storage.store import Store
t = pa.table({{"run_id": ["r"], "round": [0], "stage": ["x"], "purpose": ["rollout"], "calls": [1],
               "completions": [1], "tokens": [5]}})
Store({root!r}).commit("x", {{"generated_tokens": t}}, run_id="r", round=0)
"""
    flag = tmp_path / "reached"
    proc = run_python(code, env={"REFINERY_FAULT": "commit:written", "REFINERY_FAULT_FLAG": str(flag)})
    deadline = time.time() + 120
    while not flag.exists():
        assert proc.poll() is None and time.time() < deadline, "the commit ended before commit:written"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    parts = [k for k in _keys(client, bucket, "faults/generated_tokens/") if k.endswith(".parquet")]
    assert len(parts) == 1 and "/attempt=" in parts[0]  # written in place, never listed
    store = Store(root)
    assert not store.landed("r", 0, "x") and sql(store, "SELECT count(*) AS n FROM generated_tokens").to_pylist() == [{"n": 0}]
    removed = store.cleanup()  # the dead writer's claim first, then the attempt it claimed
    assert any("/.tmp/" in p for p in removed) and any("/attempt=" in p for p in removed)
    assert not _keys(client, bucket, "faults/generated_tokens/") and not _keys(client, bucket, "faults/.tmp/")


HOLD = """
import sys, time
from pathlib import Path
from storage.runs import run_lock
from storage.store import Store
with run_lock(Store(sys.argv[1]), "busy"):
    Path(sys.argv[2]).touch()
    while not Path(sys.argv[3]).exists():
        time.sleep(0.05)
"""


def test_a_second_host_on_a_running_run_id_is_refused_naming_the_holder(s3, tmp_path):
    """Another machine: its own local lock folder (XDG_CACHE_HOME), the same bucket. Only the lease stops it."""
    import subprocess

    from storage.runs import RunLocked, run_lock

    _, bucket = s3
    root = f"s3://{bucket}/locks"
    held, done = tmp_path / "held", tmp_path / "done"
    other = subprocess.Popen([sys.executable, "-c", HOLD, root, str(held), str(done)], cwd=ROOT,
                             env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "other-host-cache")})
    try:
        deadline = time.time() + 60
        while not held.exists():
            assert other.poll() is None and time.time() < deadline
            time.sleep(0.05)
        with pytest.raises(RunLocked) as refused:
            with run_lock(Store(root), "busy"):
                pass
        assert str(refused.value).startswith(f"run busy is already running (pid {other.pid} on ")
        assert "lease in the store" in str(refused.value) and "\n" not in str(refused.value)
    finally:
        done.touch()
        other.wait(timeout=60)
    assert other.returncode == 0 and not _keys(s3[0], bucket, "locks/.leases/")  # released with its holder


def test_an_expired_lease_is_taken_over_and_a_held_one_renewed(s3, monkeypatch):
    from storage.runs import run_lock

    client, bucket = s3
    key = "expired/.leases/run-r.json"
    client.put_object(Bucket=bucket, Key=key, Body=json.dumps(
        {"host": "gone-host", "pid": 1, "token": "old", "expires_at": time.time() - 1}).encode())
    monkeypatch.setenv("REFINERY_LEASE_TTL_S", "0.6")
    with run_lock(Store(f"s3://{bucket}/expired"), "r"):
        first = json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())
        assert first["pid"] == os.getpid() and first["token"] != "old"
        time.sleep(1.5)  # past the TTL: renewed meanwhile, so still ours and unexpired
        later = json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())
        assert later["token"] == first["token"] and later["expires_at"] > time.time()
    assert not _keys(client, bucket, key)  # released


def test_a_process_that_lost_its_lease_commits_nothing_more(s3, monkeypatch):
    """Another host took the lease over (here: overwrote it) while this one was stalled: the renewer finds it
    taken, and every later commit of this process to that store is refused, in one line."""
    import pyarrow as pa

    from storage.runs import run_lock

    client, bucket = s3
    root = f"s3://{bucket}/fenced"
    monkeypatch.setenv("REFINERY_LEASE_TTL_S", "0.6")
    with run_lock(Store(root), "r"):
        client.put_object(Bucket=bucket, Key="fenced/.leases/run-r.json", Body=json.dumps(
            {"host": "other-host", "pid": 7, "token": "theirs", "expires_at": time.time() + 60}).encode())
        time.sleep(0.8)  # past a renewal tick
        t = pa.table({"run_id": ["r"], "round": [0], "stage": ["x"], "purpose": ["rollout"], "calls": [1],
                      "completions": [1], "tokens": [5]})
        with pytest.raises(RuntimeError, match="lost the run lease .*commits nothing more"):
            Store(root).commit("x", {"generated_tokens": t}, run_id="r", round=0)
    assert json.loads(client.get_object(Bucket=bucket, Key="fenced/.leases/run-r.json")["Body"].read())["token"] \
        == "theirs"  # not released: it is not ours
    assert not Store(root).landed("r", 0, "x")


@pytest.mark.slow
def test_rounds_without_an_update_chain_their_recorded_checkpoint_on_s3(prefect_api, s3):
    """The tiny random model never answers correctly and nothing is shaped, so no round trains: each new
    version is recorded where its parent is, and the next rounds find it."""
    from test_curriculum import TINY

    _, bucket = s3
    root = f"s3://{bucket}/nostep"
    code, _, err = run_cli("run", "--run-id", "flat", "--rounds", "3", "--store", root,
                           *[x for s in [*TINY, "shape.enabled=false", "refine.strategies=[]"] for x in ("--set", s)])
    assert code == 0, err
    rows = sql(Store(root), "SELECT policy_version, path FROM checkpoints ORDER BY 1").to_pylist()
    assert [r["policy_version"] for r in rows] == [0, 1, 2, 3]
    assert {r["path"] for r in rows} == {"tiny-random"}  # the built-in base by name: no machine's cache folder
    assert sql(Store(root), "SELECT count(*) AS n FROM train_steps").to_pylist() == [{"n": 0}]
