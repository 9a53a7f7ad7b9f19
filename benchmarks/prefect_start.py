"""A fresh Prefect home's first flow run: from a new database file, which Prefect's ephemeral server migrates
before it answers (the baseline), against from the migrated copy `refinery` puts in a new store's home
(flows/server/prefect_home.py seed_database).

Each run is a child interpreter with its own new PREFECT_HOME that imports Prefect and times its first no-op
flow run (server start, database, the run itself); the arms alternate their order repeat by repeat, so load
that drifts over the run does not favour one. The migrated copy is made first if this machine has none (not
timed: it is made once per machine and Prefect version).

A second comparison times `refinery run`'s start, from the command's first line to its first flow run (a no-op
flow in place of the curriculum): `flows.cli.commands.prepared_run` (import and check the default config, import
the flow) with Prefect's server started at the first flow call, as before flows/server/early_server.py (the baseline),
against started as a child process as the command begins. Each is a child interpreter with a new, seeded home; the
arms alternate their order repeat by repeat.

    python benchmarks/prefect_start.py [--repeats 3] [--json PATH]

Figures (--json, flat keys): prefect_first_run_new_s and prefect_first_run_seeded_s (medians), their min and
max, prefect_seeded_speedup (new / seeded, the median of the repeats' ratios); run_start_at_flow_s and
run_start_early_s (medians, with min and max), run_start_saved_s (the median of the repeats' differences).
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run as a script, this folder's select.py would shadow the standard library's `select`
import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

CHILD = """import time
from prefect import flow
@flow(name="noop")
def noop():
    return 1
t = time.perf_counter()
noop()
print(time.perf_counter() - t)
"""
RUN_CHILD = """import sys, time
t = time.perf_counter()
import argparse
from flows.cli.commands import prepared_run
a = argparse.Namespace(store=sys.argv[2], verbose=False, config=None, set=[], run_id="bench", rounds=None)
prepared_run(a, early_server=sys.argv[1] == "early")
from prefect import flow
@flow(name="noop")
def noop():
    return 1
noop()
print(time.perf_counter() - t)
"""


def child_env(home: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    return env | {"PREFECT_HOME": home, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                  "PREFECT_LOGGING_LEVEL": "WARNING", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300"}


def run_start(early: bool) -> float:
    """Seconds from `refinery run`'s first line to its first flow run's end, in a child with a new home."""
    with tempfile.TemporaryDirectory(prefix="refinery-run-start-") as tmp:
        home = str(Path(tmp) / "home")
        proc = subprocess.run([sys.executable, "-c", RUN_CHILD, "early" if early else "at_flow", str(Path(tmp) / "store")],
                              env=child_env(home) | {"HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                              timeout=600, cwd=Path(__file__).resolve().parents[1])
        if proc.returncode != 0:
            sys.exit(f"prefect_start: the run's start failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        return float(proc.stdout.strip().splitlines()[-1])


def first_run(seeded: bool) -> float:
    from flows.server.prefect_home import DATABASE, seed_database

    with tempfile.TemporaryDirectory(prefix="refinery-prefect-start-") as home:
        if seeded and not seed_database(Path(home)).startswith("seeded"):
            sys.exit("prefect_start: the home was not seeded (is PREFECT_API_URL or a database URL set?)")
        proc = subprocess.run([sys.executable, "-c", CHILD], env=child_env(home), capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            sys.exit(f"prefect_start: the child flow run failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        if not (Path(home) / DATABASE).exists():
            sys.exit(f"prefect_start: Prefect did not use {Path(home) / DATABASE}")
        return float(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the figures as flat keys")
    a = ap.parse_args()
    for k in ("PREFECT_API_URL", "PREFECT_API_DATABASE_CONNECTION_URL", "PREFECT_SERVER_DATABASE_CONNECTION_URL"):
        os.environ.pop(k, None)
    with tempfile.TemporaryDirectory() as warm:  # makes the migrated copy where this machine has none
        from flows.server.prefect_home import seed_database

        print(f"migrated copy: {seed_database(Path(warm))}")
    times: dict[bool, list[float]] = {False: [], True: []}
    for rep in range(a.repeats):
        for seeded in ((False, True) if rep % 2 == 0 else (True, False)):
            times[seeded].append(first_run(seeded))
        print(f"repeat {rep}: new file {times[False][-1]:.1f} s, seeded {times[True][-1]:.1f} s", flush=True)
    ratios = [new / seeded for new, seeded in zip(times[False], times[True])]
    figures = {"prefect_seeded_speedup": statistics.median(ratios)}
    for seeded, name in ((False, "new"), (True, "seeded")):
        v = times[seeded]
        figures |= {f"prefect_first_run_{name}_s": statistics.median(v), f"prefect_first_run_{name}_min_s": min(v),
                    f"prefect_first_run_{name}_max_s": max(v)}
        print(f"first flow run, {name}: median {statistics.median(v):.1f} s (min {min(v):.1f}, max {max(v):.1f})")
    print(f"prefect_seeded_speedup (new / seeded, median of the repeats' ratios) = "
          f"{figures['prefect_seeded_speedup']:.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})")
    starts: dict[bool, list[float]] = {False: [], True: []}
    for rep in range(a.repeats):
        for early in ((False, True) if rep % 2 == 0 else (True, False)):
            starts[early].append(run_start(early))
        print(f"repeat {rep}: run start, server at the flow call {starts[False][-1]:.1f} s, early "
              f"{starts[True][-1]:.1f} s", flush=True)
    saved = [late - early for late, early in zip(starts[False], starts[True])]
    figures["run_start_saved_s"] = statistics.median(saved)
    for early, name in ((False, "at_flow"), (True, "early")):
        v = starts[early]
        figures |= {f"run_start_{name}_s": statistics.median(v), f"run_start_{name}_min_s": min(v),
                    f"run_start_{name}_max_s": max(v)}
        print(f"run start to its first flow, server {name}: median {statistics.median(v):.1f} s (min {min(v):.1f}, "
              f"max {max(v):.1f})")
    print(f"run_start_saved_s (median of the repeats' differences) = {figures['run_start_saved_s']:.1f} "
          f"(min {min(saved):.1f}, max {max(saved):.1f})")
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=1))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
