"""Orchestration overhead of the curriculum flow (issue 6): what Prefect and the flow's bookkeeping cost on top
of the stages' own compute. Target: <= 5% of a round's wall time, with Prefect's start-up reported apart.

In one process:
1. Prefect start-up: the first flow run of a process starts the ephemeral API server (or connects to
   $PREFECT_API_URL); timed as a no-op flow's first run minus its second run.
2. A no-op flow's run (the per-flow cost once the API is up), median of --repeats.
3. The curriculum flow at the default sizes (override with --set, e.g. --tiny for a quick check). Every
   stage's task measures its own compute inside the task function (`tasks.reporting.progress.timed`), so for round r:
       wall_r     = end of round r's last stage - end of round r-1's last stage (round 0: from the call)
       compute_r  = sum of round r's stages' compute_s
       overhead_r = (wall_r - compute_r) / wall_r       <- the named baseline is compute_r
   Round 0's wall includes creating the flow run, the run lock and the `runs` row; no round includes the
   server start-up, which step 1 already paid.

--json PATH writes the figures as flat keys: prefect_startup_s, noop_flow_s, imports_s, flow_s, and per
measured round r round_<r>_wall_s, round_<r>_compute_s, round_<r>_overhead; overhead_median (the target's figure).

    python benchmarks/overhead.py [--rounds 1] [--store DIR] [--set section.key=value ...] [--tiny] [--json PATH]
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run as a script, benchmarks/select.py would shadow the standard library's `select`

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

TINY = ["model.policy=tiny-random", "model.dtype=fp32", "rollout.max_new_tokens=8", "rollout.group_size=4",
        "select.embedder=hashing", "select.batch_size=8",
        'pool.sources=[{"source": "rg:products", "size": 12, "params": {"max_digits": 1}}]']


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--store", default=None, help="default: a fresh temporary folder")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--tiny", action="store_true", help="the tiny random model and a 12-prompt pool (a quick check)")
    p.add_argument("--repeats", type=int, default=5, help="no-op flow runs")
    p.add_argument("--json", default=None, metavar="PATH", help="write the figures as flat keys")
    a = p.parse_args()
    store = a.store or tempfile.mkdtemp(prefix="refinery-overhead-")
    os.environ.setdefault("PREFECT_HOME", str(Path(store).resolve() / ".prefect"))
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)  # Prefect does not create parents
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

    t = time.perf_counter()
    from prefect import flow

    from flows.config import load_config
    from flows.curriculum import curriculum
    imports = time.perf_counter() - t

    @flow(name="noop")
    def noop() -> int:
        return 1

    t = time.perf_counter()
    noop()
    first = time.perf_counter() - t
    runs = []
    for _ in range(a.repeats):
        t = time.perf_counter()
        noop()
        runs.append(time.perf_counter() - t)
    per_flow = statistics.median(runs)
    print(f"imports (prefect, flows): {imports:.2f} s")
    print(f"prefect start-up: {first - per_flow:.2f} s (first no-op flow {first:.2f} s - a later one {per_flow:.2f} s)")
    print(f"no-op flow run: median {per_flow:.3f} s of {a.repeats}")
    figures = {"imports_s": imports, "prefect_startup_s": first - per_flow, "noop_flow_s": per_flow}

    config = load_config(sets=[*(TINY if a.tiny else []), *a.set], run_id="overhead", store=store, rounds=a.rounds)
    t_call = time.perf_counter()
    out = curriculum(config)
    total = time.perf_counter() - t_call
    previous_end = t_call
    fractions = []
    print(f"{'round':>5} {'wall s':>9} {'compute s':>10} {'overhead s':>11} {'overhead':>9}   stages (compute s)")
    for r in range(a.rounds):
        stages = [s for s in out["stages"] if s.get("round") == r and "timing" in s]
        if any("skipped" in s for s in stages):
            print(f"{r:>5} resumed from an earlier run; not measured")
            previous_end = max(s["timing"]["end"] for s in stages)
            continue
        end = max(s["timing"]["end"] for s in stages)
        wall = end - previous_end
        compute = sum(s["timing"]["compute_s"] for s in stages)
        fractions.append((wall - compute) / wall)
        figures |= {f"round_{r}_wall_s": wall, f"round_{r}_compute_s": compute, f"round_{r}_overhead": fractions[-1]}
        detail = ", ".join(f"{s['stage']} {s['timing']['compute_s']:.1f}" for s in stages)
        print(f"{r:>5} {wall:>9.1f} {compute:>10.1f} {wall - compute:>11.2f} {fractions[-1]:>8.1%}   {detail}")
        previous_end = end
    tail = total - (previous_end - t_call)
    print(f"after the last stage (completed row, flow run end): {tail:.2f} s; flow total {total:.1f} s")
    figures["flow_s"] = total
    if fractions:
        med = statistics.median(fractions)
        figures["overhead_median"] = med
        print(f"orchestration overhead: median {med:.2%} of a round's wall time vs its stages' own compute "
              f"(target <= 5%): {'met' if med <= 0.05 else 'NOT met'}")
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=1, sort_keys=True))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
