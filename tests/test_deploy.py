"""`refinery serve` end to end: a real Prefect server, the process work pool, prefect.yaml's deployments and a
worker; a curriculum run started the way the UI's form starts it; then `refinery serve --stop` leaves no process
and no open port behind."""

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from flows.config import load_config
from models.threads import default_concurrency
from storage.query import sql
from storage.store import Store

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _descendants(pid: int) -> dict[psutil.Process, int]:
    """The descendants of `pid` with their process groups."""
    out = {}
    for p in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(ProcessLookupError):
            out[p] = os.getpgid(p.pid)
    return out


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _refinery(*args: str, env: dict, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env, **kw)


@pytest.fixture
def serve_env(tmp_path):
    """The environment of a user's shell: no Prefect home or API of the test session; fast worker polling."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_HOME", "PREFECT_API_URL", "REFINERY_STORE")}
    return {**env, "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "1"}


@pytest.mark.slow
def test_serve_deploys_runs_a_curriculum_and_stops_clean(tmp_path, serve_env, monkeypatch):
    store, port = tmp_path / "store", _free_port()
    out = tmp_path / "serve.out"
    t0 = time.monotonic()
    with open(out, "wb") as f:
        proc = _refinery("serve", "--store", str(store), "--port", str(port), env=serve_env, stdout=f,
                         stderr=subprocess.STDOUT, start_new_session=True)
    state_file = store / ".prefect" / "serve" / "serve.json"  # PREFECT_HOME defaults to <store>/.prefect
    seen: dict[psutil.Process, int] = {}  # every descendant of serve ever seen, flow-run processes included
    try:
        while "ready in" not in out.read_text():
            assert proc.poll() is None, f"refinery serve exited with {proc.returncode}:\n{out.read_text()}"
            assert time.monotonic() - t0 < 240, f"refinery serve not ready after 240 s:\n{out.read_text()}"
            time.sleep(0.5)
        ready_s = time.monotonic() - t0
        state = json.loads(state_file.read_text())
        assert state["pid"] == proc.pid and state["port"] == port and state["url"] == f"http://127.0.0.1:{port}"
        assert sorted(c["name"] for c in state["children"]) == ["server", "worker"]
        seen |= _descendants(proc.pid)

        monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "client-home"))  # if this is the first import of Prefect
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.schedules import CronSchedule
        from prefect.deployments import run_deployment
        from prefect.settings import PREFECT_API_URL, temporary_settings
        from test_curriculum import TINY

        # The form's parameters, without a store: the worker's REFINERY_STORE is the served store.
        config = load_config(sets=TINY, run_id="deployed", rounds=1).model_dump(mode="json")
        assert config["store"] is None
        with temporary_settings({PREFECT_API_URL: state["api_url"]}), get_client(sync_client=True) as client:
            # runs beyond the machine's share queue (models/threads.py)
            assert client.read_work_pool("refinery-process").concurrency_limit == default_concurrency()
            run = run_deployment("curriculum/curriculum", parameters={"config": config}, timeout=0)
            t1 = time.monotonic()
            while not (run := client.read_flow_run(run.id)).state.is_final():
                seen |= _descendants(proc.pid)
                assert time.monotonic() - t1 < 240, f"flow run still {run.state.name} after 240 s"
                time.sleep(1)
            run_s = time.monotonic() - t1
            assert run.state.is_completed(), f"flow run ended {run.state.name}: {run.state.message}"

            curriculum = client.read_deployment_by_name("curriculum/curriculum")
            assert curriculum.work_pool_name == "refinery-process"
            # the UI's form: RunConfig's fields with their descriptions, bounds and choices
            form = curriculum.parameter_openapi_schema
            defs = form["definitions"] if "definitions" in form else form["$defs"]
            rollout = defs["RolloutConfig"]["properties"]
            assert rollout["group_size"]["minimum"] == 2 and rollout["group_size"]["description"]
            from tasks.select import SELECTORS  # the registered selectors (tasks/selectors/), as the config offers them

            assert defs["SelectConfig"]["properties"]["selector"]["enum"] == list(SELECTORS)
            assert {"kmeans", "uniform", "dapo_filter", "all", "thompson"} <= set(SELECTORS)
            rescore = client.read_deployment_by_name("rescore/rescore")  # nightly, from prefect.yaml
            crons = [s.schedule.cron for s in rescore.schedules if s.active and isinstance(s.schedule, CronSchedule)]
            assert crons == ["0 3 * * *"]

        served = Store(str(store))
        statuses = sql(served, "SELECT status FROM runs WHERE run_id = 'deployed' ORDER BY created_at")
        assert statuses.column("status").to_pylist() == ["running", "completed"]
        rollouts = sql(served, "SELECT count(*) AS n FROM rollouts WHERE run_id = 'deployed'").to_pylist()[0]["n"]
        assert rollouts > 0

        t2 = time.monotonic()
        stop = _refinery("serve", "--stop", "--store", str(store), env=serve_env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        stdout, stderr = stop.communicate(timeout=120)
        assert stop.returncode == 0, stderr
        assert f"stopped refinery serve (pid {proc.pid})" in stdout and f"port {port} is closed" in stdout
        assert proc.wait(timeout=30) == 0  # the orderly stop, not a kill
        stop_s = time.monotonic() - t2
    finally:
        if proc.poll() is None:  # the test failed midway: take everything down
            from flows.server.serve import stop_running

            with contextlib.suppress(Exception):
                stop_running(store / ".prefect", timeout=30)
            proc.kill()
            proc.wait()
    assert not state_file.exists()
    # the flow run's processes were seen, in a session of their own (Prefect's process worker puts them there)
    assert set(seen.values()) - {c["pgid"] for c in state["children"]}
    assert not [p for p in seen if _running(p)]
    assert not _port_open(port)
    print(f"ready in {ready_s:.0f} s, flow run {run_s:.0f} s, stop {stop_s:.0f} s")


def test_stop_when_nothing_is_serving(tmp_path, monkeypatch):
    from flows.cli import main

    monkeypatch.delenv("PREFECT_HOME", raising=False)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["serve", "--stop", "--store", str(tmp_path / "store")]) == 1
    home = (tmp_path / "store" / ".prefect").resolve()
    assert err.getvalue() == f"refinery: error: nothing is serving from {home} (no serve/serve.json)\n"


def test_serve_on_a_port_in_use_fails_fast(tmp_path, monkeypatch):
    from flows.cli import main

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "home"))
    before = set(psutil.Process().children(recursive=True))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        err, t0 = io.StringIO(), time.monotonic()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            assert main(["serve", "--port", str(port), "--store", str(tmp_path / "store")]) == 1
    assert time.monotonic() - t0 < 10
    assert f"port {port} on 127.0.0.1 is already in use; choose another with --port" in err.getvalue()
    assert set(psutil.Process().children(recursive=True)) <= before  # nothing was started


def _write_state(home: Path, pid: int, created: float, port: int, children: list) -> None:
    from dataclasses import asdict

    (home / "serve").mkdir(parents=True)
    (home / "serve" / "serve.json").write_text(json.dumps(
        {"pid": pid, "created": created, "port": port, "url": f"http://127.0.0.1:{port}",
         "children": [asdict(c) for c in children]}))


def test_stop_ends_what_a_killed_serve_left_behind(tmp_path):
    """serve died without stopping its children: --stop stops the recorded groups itself, escalates to SIGKILL
    for a worker that ignores SIGINT, and ends the process the worker had put in a session of its own."""
    from flows.server.serve import stop_running
    from flows.server.sessions import Child

    stubborn = ("import signal, subprocess, sys, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                "p = subprocess.Popen(['sleep', '300'], start_new_session=True); print(p.pid, flush=True); "
                "time.sleep(300)")
    worker = subprocess.Popen([sys.executable, "-c", stubborn], start_new_session=True, stdout=subprocess.PIPE)
    server = subprocess.Popen(["sleep", "300"], start_new_session=True)
    flow_run = psutil.Process(int(worker.stdout.readline()))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    children = [Child(name, p.pid, p.pid, psutil.Process(p.pid).create_time(), "")
                for name, p in (("server", server), ("worker", worker))]
    _write_state(tmp_path / "home", dead.pid, 0.0, _free_port(), children)
    t0 = time.monotonic()
    state = stop_running(tmp_path / "home", timeout=5, child_timeout=1)
    assert state["pid"] == dead.pid and time.monotonic() - t0 < 15
    assert worker.wait(timeout=1) == -9 and server.wait(timeout=1) == -15  # SIGINT ignored, so SIGKILL
    assert not flow_run.is_running() or flow_run.status() == psutil.STATUS_ZOMBIE
    assert not (tmp_path / "home" / "serve" / "serve.json").exists()


def test_a_second_serve_on_the_same_home_is_refused(tmp_path):
    from flows.server.serve import ServeError, start

    me = psutil.Process()
    _write_state(tmp_path / "home", me.pid, me.create_time(), 4200, [])
    with pytest.raises(ServeError, match=rf"refinery serve \(pid {me.pid}\) is already serving .*home at "
                                         r"http://127.0.0.1:4200; stop it with `refinery serve --stop`"):
        start(str(tmp_path / "store"), _free_port(), home=tmp_path / "home", echo=lambda m: None)
