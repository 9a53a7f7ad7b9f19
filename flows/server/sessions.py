"""Children in sessions of their own, and stopping them without leaving orphans.

`refinery serve` starts the Prefect server and worker with start_new_session=True so that a Ctrl-C at the terminal
reaches only serve, which then stops them in order. A child's whole process group is signalled, then SIGKILLed after
a timeout; descendants that moved to sessions of their own (Prefect's process worker starts every flow run so) are
found before the signal and ended after it. PIDs are recorded with their start times, so a reused PID is never
mistaken for a child.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass

import psutil

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # Ctrl-C, kill, a closed terminal


@dataclass
class Child:
    name: str
    pid: int
    pgid: int
    created: float  # the process's start time, so that a reused PID is never mistaken for it
    log: str


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextmanager
def uninterruptible():
    """Ignore further Ctrl-Cs while stopping: the stop is bounded in time, and cutting it short leaves orphans."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def same_process(pid: int, created: float) -> psutil.Process | None:
    """The process `pid` if it is still the one that started at `created`."""
    try:
        p = psutil.Process(pid)
        return p if abs(p.create_time() - created) < 0.01 else None
    except psutil.Error:
        return None


def running(c: Child) -> bool:
    p = same_process(c.pid, c.created)
    return p is not None and _alive(p)


def _alive(p: psutil.Process) -> bool:
    """Still running. A zombie is not: it has exited, and waits for its parent (psutil.wait_procs would wait on it
    until the timeout when it is not our child). Its parent, not this, reaps it, keeping its exit status."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_gone(procs, timeout: float) -> list[psutil.Process]:
    """Wait up to `timeout` for every process to exit; returns those still running."""
    deadline = time.monotonic() + timeout
    while (alive := [p for p in procs if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _group(pgid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid:
                out.append(p)
        except (ProcessLookupError, PermissionError):
            pass
    return out


def stop_child(c: Child, sig: signal.Signals, timeout: float) -> None:
    """Signal c's group, SIGKILL what is left of it after `timeout`, then end its descendants in other sessions."""
    group = _group(c.pgid)
    others = {d for p in group for d in _descendants(p)} - set(group)
    with suppress(ProcessLookupError):
        os.killpg(c.pgid, sig)
    if alive := wait_gone(group, timeout):
        with suppress(ProcessLookupError):
            os.killpg(c.pgid, signal.SIGKILL)
        wait_gone(alive, 10)
    others = [p for p in others if _alive(p)]
    for p in others:
        with suppress(psutil.Error):
            p.terminate()
    for p in wait_gone(others, 10):
        with suppress(psutil.Error):
            p.kill()
    wait_gone(others, 10)


def _descendants(p: psutil.Process) -> list[psutil.Process]:
    try:
        return p.children(recursive=True)
    except psutil.Error:
        return []


def stop_children(children: list[Child], timeout: float) -> None:
    for c in reversed(children):  # the worker before the server it reports to
        stop_child(c, signal.SIGINT if c.name == "worker" else signal.SIGTERM, timeout)
