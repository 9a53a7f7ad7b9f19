"""`refinery serve`: a local Prefect server, the process work pool, prefect.yaml's deployments and a worker, as one
foreground command that leaves nothing behind.

Choices, and why:
- Each child (server, worker, `prefect deploy`) starts in a session of its own (flows/server/sessions.py), so a Ctrl-C at
  the terminal reaches only this process, which then stops them in order: the worker first, with SIGINT (a Prefect
  worker's graceful stop), then the server with SIGTERM, each escalated to SIGKILL of its group after a timeout,
  and the flow runs the worker had started (in sessions of their own) after them: no flow run outlives `serve`.
- PREFECT_HOME is <store>/.prefect (or $PREFECT_HOME), as for every refinery command; the worker gets
  REFINERY_STORE, so a deployment run with default parameters writes to the store that was served.
- The work pool is created with a concurrency limit (`--concurrency`, default models/threads.py's
  `default_concurrency`: a run per 2 cores and 6 GiB), so runs started from the UI beyond it queue instead of
  oversubscribing the machine; an existing pool keeps its own limit.
- <prefect home>/serve/serve.json records this process and its children, so `refinery serve --stop` from another
  shell asks this process (SIGINT) for the orderly stop, and stops the recorded groups itself only if it is gone.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import psutil

from flows.server import sessions
from flows.server.prefect_home import prefect_home  # one rule for every command and serve
from flows.server.sessions import Child
from models.threads import default_concurrency

REPO = Path(__file__).resolve().parents[2]  # the folder holding prefect.yaml
HOST = "127.0.0.1"
POOL = "refinery-process"


class ServeError(RuntimeError):
    """A reason `refinery serve` could not start or stop, naming the port or log to look at."""

    user_facing = True  # the CLI prints it as one line


def _tail(log: str | Path, lines: int = 15) -> str:
    try:
        text = Path(log).read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return "\n" + "\n".join("  | " + t for t in text) if text else ""


@dataclass
class Served:
    port: int
    home: Path
    store: str
    pid: int = field(default_factory=os.getpid)
    started_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    children: list[Child] = field(default_factory=list)
    seconds: float = 0.0  # from starting the server to ready

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def api_url(self) -> str:
        return self.url + "/api"

    @property
    def logs(self) -> Path:
        return self.home / "serve"

    def env(self) -> dict[str, str]:
        """Every child's environment: this server, this store, and logs a person can read."""
        return {**os.environ, "PREFECT_HOME": str(self.home), "PREFECT_API_URL": self.api_url,
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_LOGGING_LEVEL": "INFO",
                "REFINERY_STORE": self.store, "PWD": str(REPO)}  # prefect.yaml's pull step reads {{ $PWD }}

    def spawn(self, name: str, *args: str) -> tuple[Child, subprocess.Popen]:
        log = self.logs / f"{name}.log"
        with open(log, "wb") as out:
            p = subprocess.Popen([sys.executable, "-m", "prefect", *args], cwd=REPO, env=self.env(),
                                 stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        child = Child(name, p.pid, os.getpgid(p.pid), psutil.Process(p.pid).create_time(), str(log))
        self.children.append(child)
        self.write_state()
        return child, p

    def write_state(self) -> None:
        state = {"pid": self.pid, "created": psutil.Process(self.pid).create_time(), "port": self.port,
                 "url": self.url, "api_url": self.api_url, "store": self.store, "started_at": self.started_at,
                 "children": [asdict(c) for c in self.children]}
        tmp = self.logs / "serve.json.tmp"
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.logs / "serve.json")

    def stop(self, timeout: float = 30.0) -> None:
        """Worker first (SIGINT), then the server (SIGTERM); then check that the port has closed."""
        with sessions.uninterruptible():
            sessions.stop_children(self.children, timeout)
            if _read_state(self.home).get("pid") == self.pid:
                (self.logs / "serve.json").unlink(missing_ok=True)
        _wait_port_closed(self.port)


def _read_state(home: Path) -> dict:
    try:
        return json.loads((home / "serve" / "serve.json").read_text())
    except (OSError, ValueError):
        return {}


def _wait_port_closed(port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while sessions.port_open(port):
        if time.monotonic() > deadline:
            raise ServeError(f"port {port} on {HOST} is still open {timeout:.0f} s after stopping the server")
        time.sleep(0.2)


def _wait_healthy(served: Served, server: subprocess.Popen, log: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if server.poll() is not None:
            raise ServeError(f"the Prefect server exited with code {server.returncode} before answering; "
                             f"see {log}{_tail(log)}")
        try:
            with urllib.request.urlopen(served.api_url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise ServeError(f"the Prefect server on port {served.port} did not answer {served.api_url}/health "
                             f"within {timeout:.0f} s; see {log}")
        time.sleep(0.5)


@contextmanager
def _client(api_url: str):
    """A sync Prefect client on this server, whatever API the calling process was set up with."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        yield client


def _ensure_pool(api_url: str, pool: str, concurrency: int) -> None:
    """Create the process work pool with `concurrency` as its limit (runs beyond it queue); a pool that exists
    keeps the limit it has (a user may have set it in the UI)."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists
    from prefect.workers.process import ProcessWorker

    with _client(api_url) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=pool, type="process", concurrency_limit=concurrency,
                                                   base_job_template=ProcessWorker.get_default_base_job_template()))
        except ObjectAlreadyExists:
            if (kind := client.read_work_pool(pool).type) != "process":
                raise ServeError(f"work pool {pool!r} already exists with type {kind!r}; serve needs a process "
                                 "pool (choose another with --pool)") from None


def _wait_worker(served: Served, worker: subprocess.Popen, name: str, pool: str, log: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with _client(served.api_url) as client:
        while not any(w.name == name and w.status == "ONLINE" for w in client.read_workers_for_work_pool(pool)):
            if worker.poll() is not None:
                raise ServeError(f"the worker exited with code {worker.returncode}; see {log}{_tail(log)}")
            if time.monotonic() > deadline:
                raise ServeError(f"the worker did not come online in pool {pool!r} within {timeout:.0f} s; see {log}")
            time.sleep(0.5)


def _say(message: str) -> None:
    print(message, flush=True)


def start(store: str, port: int = 4200, pool: str = POOL, home: Path | None = None, timeout: float = 180.0,
          concurrency: int | None = None,
          echo=_say) -> Served:
    """Start server, pool, worker and deployments; on any failure (or Ctrl-C) stop what was started, then raise."""
    local = "://" not in store or store.startswith("file://")
    store = str(Path(store.removeprefix("file://")).resolve()) if local else store
    served = Served(port, (home or prefect_home(store)).resolve(), store)
    served.logs.mkdir(parents=True, exist_ok=True)
    previous = _read_state(served.home)
    if previous and sessions.same_process(previous["pid"], previous["created"]):
        raise ServeError(f"refinery serve (pid {previous['pid']}) is already serving {served.home} at "
                         f"{previous['url']}; stop it with `refinery serve --stop`")
    if previous:  # its serve process died without stopping its children
        echo(f"stopping what a previous serve (pid {previous['pid']}) left running")
        sessions.stop_children([Child(**c) for c in previous["children"]], 30.0)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            raise ServeError(f"port {port} on {HOST} is already in use; choose another with --port") from None
    t0 = time.monotonic()
    try:
        echo(f"starting the Prefect server on {served.url} (PREFECT_HOME {served.home}; logs in {served.logs})")
        server, p = served.spawn("server", "server", "start", "--host", HOST, "--port", str(port), "--analytics-off")
        _wait_healthy(served, p, server.log, timeout)
        echo(f"server up in {time.monotonic() - t0:.0f} s; work pool {pool!r}, worker, `prefect deploy --all`")
        _ensure_pool(served.api_url, pool, concurrency or default_concurrency())
        name = f"refinery-serve-{served.pid}"
        worker, w = served.spawn("worker", "worker", "start", "--pool", pool, "--name", name)
        deploy, d = served.spawn("deploy", "--no-prompt", "deploy", "--all")
        try:
            rc = d.wait(timeout)
        except subprocess.TimeoutExpired:
            raise ServeError(f"`prefect deploy --all` took over {timeout:.0f} s; see {deploy.log}") from None
        served.children.remove(deploy)
        served.write_state()
        if rc != 0:
            raise ServeError(f"`prefect deploy --all` in {REPO} failed (exit {rc}); see {deploy.log}{_tail(deploy.log)}")
        _wait_worker(served, w, name, pool, worker.log, timeout)
    except BaseException:
        served.stop()
        raise
    served.seconds = time.monotonic() - t0
    return served


def run(store: str, port: int = 4200, pool: str = POOL, echo=_say, concurrency: int | None = None) -> int:
    """`refinery serve`: start, then block until SIGINT/SIGTERM (or a child dies), then stop everything."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    handlers = {sig: signal.signal(sig, interrupt) for sig in sessions.STOP_SIGNALS}
    served = None
    try:
        served = start(store, port, pool, echo=echo, concurrency=concurrency)
        with _client(served.api_url) as client:
            names = sorted(f"{client.read_flow(d.flow_id).name}/{d.name}" for d in client.read_deployments())
        echo(f"ready in {served.seconds:.0f} s. Prefect UI: {served.url}\n"
             f"deployments: {', '.join(names)}; work pool {pool!r}; store {served.store}\n"
             f"stop with Ctrl-C, or from another shell: refinery serve --stop --store {served.store}")
        while True:
            time.sleep(1)
            if dead := [c for c in served.children if not sessions.running(c)]:
                raise ServeError(f"the {dead[0].name} exited unexpectedly; see {dead[0].log}{_tail(dead[0].log)}")
    except KeyboardInterrupt:
        return 0
    finally:
        for sig in handlers:  # no KeyboardInterrupt before stop() has taken over the signals
            signal.signal(sig, signal.SIG_IGN)
        try:
            if served is not None:
                echo("stopping the worker, then the server")
                served.stop()
                echo(f"stopped; port {port} is closed")
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)


def stop_running(home: Path, timeout: float = 120.0, child_timeout: float = 30.0) -> dict:
    """`refinery serve --stop`: have the serve process recorded under `home` stop in order; returns its state."""
    state = _read_state(home)
    if not state:
        raise ServeError(f"nothing is serving from {home} (no serve/serve.json)")
    serve = sessions.same_process(state["pid"], state["created"])
    if serve is not None:
        serve.send_signal(signal.SIGINT)
        if sessions.wait_gone([serve], timeout):
            serve.kill()  # it did not stop in time: stop its children here
    # nothing is left when serve stopped in order; its orphans are, when it had died
    sessions.stop_children([Child(**c) for c in state["children"]], child_timeout)
    (home / "serve" / "serve.json").unlink(missing_ok=True)
    _wait_port_closed(state["port"])
    return state
