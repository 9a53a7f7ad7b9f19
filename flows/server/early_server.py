"""Prefect's temporary API server, started as `refinery run` (or compare, eval, rescore, ingest) begins, while
the command imports its modules and checks its input (flows/server/prefect_setup.py `early_prefect`).

Without an API URL, a flow's first client call starts Prefect's temporary server: it imports the server's module
(`prefect.server.api.server`, about 3 s on 2 cores), starts `SubprocessASGIServer` (a child process running
uvicorn over Prefect's app) and waits until the child answers /health (another 6-7 s). Until then the command
has only imported and checked its config (3-7 s), so the child's start, which runs on the other core, can
overlap it. `start_early` starts that child before anything imports Prefect; `ready()`, just before the flow,
waits for its answer and hands it to Prefect's `SubprocessASGIServer` singleton, from which every Prefect client
of this process (the flow's, the events', the logs') takes the server's address. Measured in
the Prefect start measured in `git show 7f3fe64:docs/performance.md`, "Prefect's start".

Choices:
- the child runs Prefect's own command for its temporary server (uvicorn over `create_app`, the UI off, the
  ephemeral flags), started without importing Prefect; importing Prefect's modules in a second thread instead
  could meet one of its import cycles halfway and hand a thread a partly initialized module;
- it is speculative: whether Prefect's settings name a server (a profile, a prefect.toml, a test harness) is
  known only once Prefect is imported, so the child starts unless the environment names one, and `ready()`
  stops it unused if the settings do. If the child failed (its port was taken meanwhile, it exited, it never
  answered), `ready()` stops it and Prefect starts its own, as it always did;
- the port is one the OS hands out free (a bind to port 0; Prefect draws from 8000-8999 and retries). uvicorn
  binds it only once the app has loaded, so another process could take it meanwhile: the server is adopted only
  if, once it answers, the process listening on the port is this child (psutil); else Prefect starts its own;
- the child is stopped when this process exits, by an `atexit` handler: Prefect flushes its events and logs in
  `threading`'s exit hooks, which run before any `atexit` handler, so they reach the server first. It is killed
  at once by `cancel()` when the command fails before its flow (and by `ready()` when unused): a server that
  served nothing has nothing to finish, and a SIGTERM would wait for its startup (5 s measured). On Linux it
  also dies with this process (PR_SET_PDEATHSIG), so a killed command leaves no server behind;
- a second `refinery run` in one process (tests) starts nothing where Prefect's server runs already.
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import importlib.util
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from flows.server.prefect_home import api_url_in_settings

log = logging.getLogger("refinery.prefect")

# what Prefect's SubprocessASGIServer sets for its child: the UI off, the server marked ephemeral
SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
STARTUP_TIMEOUT_VAR = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"  # Prefect's own wait, honoured here too


def free_port() -> int:
    """A local TCP port that was free a moment ago."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(port: int) -> list[str]:
    """Prefect's command line for its temporary server on `port` (prefect.server.api.server.SubprocessASGIServer)."""
    spec = importlib.util.find_spec("prefect")
    if spec is None or spec.origin is None:
        raise RuntimeError("prefect is not installed")
    return [sys.executable, "-m", "uvicorn", "--app-dir", str(Path(spec.origin).parent.parent), "--factory",
            "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port), "--log-level",
            "error", "--lifespan", "on"]


class EarlyServer:
    """A starting Prefect server: `ready()` before the first flow call, `cancel()` on an error before it."""

    def __init__(self, process: subprocess.Popen, port: int):
        self.process, self.port = process, port

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def ready(self) -> bool:
        """Hand the server to Prefect once it answers; False (the server stopped, Prefect starting its own as it
        would have) where Prefect's settings name a server, Prefect already has one, or this one failed."""
        from prefect.settings import PREFECT_API_URL

        if PREFECT_API_URL.value():
            return self._unused("Prefect's settings name a server")
        from prefect.server.api.server import SubprocessASGIServer

        server = SubprocessASGIServer()
        if server.running:
            return self._unused("Prefect runs its own server already")
        problem = self._wait() or self._not_listening()
        if problem:
            return self._unused(problem)
        server.port, server.server_process, server.running = self.port, self.process, True
        return True

    def cancel(self) -> None:
        """Stop the server now; the command is failing before its flow. Killed, not asked: once uvicorn has
        installed its signal handlers, a SIGTERM waits for the app's startup to finish (5 s measured), and a
        server that served nothing has nothing to finish."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        """Stop the server as Prefect stops its own: SIGTERM, then SIGKILL after 5 s."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def _wait(self) -> str | None:
        """None once the server answers /health, else why it will not."""
        wait_s = float(os.environ.get(STARTUP_TIMEOUT_VAR) or 180)
        deadline = time.monotonic() + wait_s
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # a local server: never a proxy
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return f"the server exited with code {self.process.returncode} before it answered"
            try:
                with opener.open(f"{self.api_url}/health", timeout=2) as response:
                    if response.status == 200:
                        return None
            except (urllib.error.URLError, OSError, http.client.HTTPException):
                pass
            time.sleep(0.1)
        return f"the server did not answer within {wait_s:g} s ({STARTUP_TIMEOUT_VAR})"

    def _not_listening(self) -> str | None:
        """None if this child is the process listening on its port (not another that took the port first)."""
        import psutil

        try:
            listening = any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == self.port
                            for c in psutil.Process(self.process.pid).net_connections(kind="tcp"))
        except psutil.Error as e:
            return f"its listening socket could not be checked: {e}"
        return None if listening else f"port {self.port} answers from another process"

    def _unused(self, why: str) -> bool:
        log.info("Prefect's server started early is not used: %s", why)
        self.cancel()
        return False


def prefect_server_running() -> bool:
    """Has this process's Prefect started (or adopted) its temporary server already?"""
    if "prefect.server.api.server" not in sys.modules:
        return False
    from prefect.server.api.server import SubprocessASGIServer

    return SubprocessASGIServer().running


def die_with_parent() -> None:
    """In the child, before it runs uvicorn: SIGKILL it when its parent dies (Linux's PR_SET_PDEATHSIG)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, 9)


def start_early() -> EarlyServer | None:
    """Start Prefect's temporary server in a child process, unless an API URL is set (environment, or the
    settings of a Prefect imported already); None where it was not started."""
    if os.environ.get("PREFECT_API_URL") or api_url_in_settings() or prefect_server_running():
        return None
    port = free_port()
    try:
        process = subprocess.Popen(server_command(port), env={**os.environ, **SERVER_ENV},
                                   preexec_fn=die_with_parent if sys.platform.startswith("linux") else None)
    except (OSError, RuntimeError) as e:
        log.info("Prefect's server was not started early: %s", e)
        return None
    early = EarlyServer(process, port)
    atexit.register(early.stop)
    return early
