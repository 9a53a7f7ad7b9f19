"""Thread budgets: every process that runs torch takes its share of the machine's cores, not all of them.

Two torch processes of 2 intra-op threads each on a 2-core machine ran 15x slower than one alone (a rollout
stage of 2 minutes took 29): OpenMP threads spin on cores another process needs. So:
- a process that runs torch registers itself in a per-machine folder (`<cache>/threads/<pid>`, the cache of
  models/registry.py) and, at every stage start and model load, sets torch's intra-op threads to
  `cores // live registered processes` (at least 1), where `cores` is what this process may run on (its CPU
  affinity). A registration names the pid and its start time, so a dead process, or a pid reused since, stops
  counting at once; no cleanup is needed;
- an explicit setting wins: `REFINERY_TORCH_THREADS=N`, else `OMP_NUM_THREADS` (the test suite sets it), and
  then nothing is registered or changed;
- Ray actors take the CPUs Ray reserved for them (`scale.cpus_per_worker`) and do not register: Ray already
  keeps their reservations within the cluster's CPUs, and the flow's process waits while they generate;
- `refinery serve` creates its process work pool with a concurrency limit of
  `default_concurrency()`: a run gets at least 2 cores and 6 GiB (a default run peaks near 5 GiB,
  git show 7f3fe64:docs/performance.md), so runs started from the UI beyond that queue instead of starving each other.
The share is re-read at every stage start, so a process that starts later slows the others only from their
next stage; a stage already running keeps its threads until it ends.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from models.cache import cache_root

log = logging.getLogger(__name__)
ENV = "REFINERY_TORCH_THREADS"
RUN_CORES, RUN_GIB = 2, 6  # what one run needs at least (default_concurrency)


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def folder() -> Path:
    path = cache_root() / "threads"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _started(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(record: dict) -> bool:
    started = _started(record["pid"])
    return started is not None and started == record.get("started")


def explicit() -> int | None:
    """The thread count the environment fixes (REFINERY_TORCH_THREADS, else OMP_NUM_THREADS), or None."""
    for name in (ENV, "OMP_NUM_THREADS"):
        raw = os.environ.get(name, "").strip()
        if raw:
            try:
                n = int(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a whole number of threads") from None
            if n < 1:
                raise ValueError(f"{name}={raw!r}: the thread count must be at least 1")
            return n
    return None


def register() -> None:
    """Count this process among the machine's torch processes (idempotent)."""
    pid = os.getpid()
    path = folder() / str(pid)
    record = {"pid": pid, "started": _started(pid)}
    try:
        if json.loads(path.read_text()) == record:
            return
    except (OSError, ValueError):
        pass
    tmp = path.with_name(f".{pid}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def live() -> int:
    """Registered torch processes still running on this machine (at least this one)."""
    n = 0
    for path in folder().glob("[0-9]*"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _alive(record):
            n += 1
        else:
            path.unlink(missing_ok=True)  # dead, or its pid reused: it no longer counts
    return max(n, 1)


def share() -> int:
    """This process's share of the cores now."""
    return max(1, cores() // live())


def claim() -> int:
    """Set torch's intra-op threads to this process's share (or to the explicit setting); returns it."""
    import torch

    fixed = explicit()
    if fixed is not None:
        n = fixed
    else:
        register()
        n = share()
    if torch.get_num_threads() != n:
        log.info("torch intra-op threads: %d (%s)", n, "set by the environment" if fixed is not None else
                 f"{cores()} cores shared by {live()} torch process(es) on this machine")
        torch.set_num_threads(n)
    return n


def memory_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float(RUN_GIB)


def default_concurrency() -> int:
    """Runs a machine takes at once: at least RUN_CORES cores and RUN_GIB GiB each, and at least one."""
    return max(1, min(cores() // RUN_CORES, int(memory_gib() // RUN_GIB)))
