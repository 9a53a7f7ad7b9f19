"""A fresh Prefect home's first flow run: from a new database file, which Prefect's ephemeral server migrates
before it answers (the baseline), against from the migrated copy `refinery` puts in a new store's home
(flows/prefect_home.py seed_database).

Each run is a child interpreter with its own new PREFECT_HOME that imports Prefect and times its first no-op
flow run (server start, database, the run itself); the arms alternate their order repeat by repeat, so load
that drifts over the run does not favour one. The migrated copy is made first if this machine has none (not
timed: it is made once per machine and Prefect version).

    python benchmarks/prefect_start.py [--repeats 3] [--json PATH]

Figures (--json, flat keys): prefect_first_run_new_s and prefect_first_run_seeded_s (medians), their min and
max, prefect_seeded_speedup (new / seeded, the median of the repeats' ratios).
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


def first_run(seeded: bool) -> float:
    from flows.prefect_home import DATABASE, seed_database

    with tempfile.TemporaryDirectory(prefix="refinery-prefect-start-") as home:
        if seeded and not seed_database(Path(home)).startswith("seeded"):
            sys.exit("prefect_start: the home was not seeded (is PREFECT_API_URL or a database URL set?)")
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env |= {"PREFECT_HOME": home, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "PREFECT_LOGGING_LEVEL": "WARNING", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300"}
        proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
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
        from flows.prefect_home import seed_database

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
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=1))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
