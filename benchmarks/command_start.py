"""What a user waits for from `refinery eval` and `refinery rescore`: wall time from the process's start to
its exit, for a refused input and for an eval whose flow has little to do, side by side with a baseline commit.

    python benchmarks/command_start.py [--baseline REF] [--repeats 3] [--json PATH]

Setup (not timed): a new store under /tmp holding one tiny-model run of one round with its held-out
evaluation (`refinery run` of this checkout), then one `refinery eval` of its version 0 per arm, so that every
timed eval only reports (a commit before 8f148bf samples version 0 again there once, as stage `eval-v0`; later
ones report the run's own evaluation from the start). Timed, in each repeat, every command once per arm, the arms' order alternating
repeat by repeat so that load drifting over the run favours neither:
- `eval_landed`: `refinery eval --run-id bench` (version 0 evaluated already: the flow reports what landed);
- `eval_unknown`: `refinery eval --run-id nope` (refused: no such run in the store);
- `rescore_unknown`: `refinery rescore --run-id nope` (refused likewise).
Each call is a child interpreter running `flows.cli.main` with the arm's tree as its working directory (so its
code comes first on sys.path), the store's own Prefect home, and no Prefect API URL: each command starts
Prefect's temporary server as it would for a user. The baseline is a git worktree of REF (benchmarks/round.py
`baseline_tree`), removed afterwards.

Figures (--json, flat keys), seconds: `<command>_s` (median), `<command>_min_s`, `<command>_max_s`; with
--baseline the same prefixed `baseline_`, and `<command>_saved_s` (the median of the repeats' differences,
baseline minus this checkout).
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run as a script, this folder's select.py would shadow the standard library's `select`
import argparse  # noqa: E402
import contextlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAIN = "import sys; from flows.cli import main; sys.exit(main())"
TINY = ["model.policy=tiny-random", "model.dtype=fp32", "rollout.max_new_tokens=4", "rollout.group_size=2",
        "select.selector=all", "rollout.lope_prefixes=0", "rollout.fewshot_k=0", "refine.strategies=[]",
        "shape.enabled=false", "train.enabled=false",
        'pool.sources=[{"source": "rg:products", "size": 8, "params": {"max_digits": 1}}]']
COMMANDS = {  # name -> (arguments after --store, the exit code it must give)
    "eval_landed": (["eval", "--run-id", "bench"], 0),
    "eval_unknown": (["eval", "--run-id", "nope"], 1),
    "rescore_unknown": (["rescore", "--run-id", "nope"], 1),
}


def refinery(tree: Path, store: Path, args: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "REFINERY_"))}
    env |= {"PREFECT_HOME": str(store / ".prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", MAIN, *args[:1], "--store", str(store), *args[1:]], cwd=tree,
                          env=env, capture_output=True, text=True, timeout=600)


def timed(tree: Path, store: Path, name: str) -> float:
    args, code = COMMANDS[name]
    t = time.perf_counter()
    proc = refinery(tree, store, args)
    seconds = time.perf_counter() - t
    if proc.returncode != code:
        sys.exit(f"command_start.py: {name} in {tree} exited {proc.returncode}, not {code}: "
                 f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return seconds


def setup(store: Path, trees: dict[str, Path]) -> None:
    made = refinery(ROOT, store, ["run", "--run-id", "bench", "--rounds", "1", *sum((["--set", s] for s in TINY), [])])
    if made.returncode:
        sys.exit(f"command_start.py: the setup run failed: {(made.stderr.strip().splitlines() or ['?'])[-1]}")
    for tree in trees.values():  # before 8f148bf the first arm lands eval-v0 here; later commits only report
        timed(tree, store, "eval_landed")


def round_bench():
    """benchmarks/round.py as a module (benchmarks/ is not a package): its worktree helper."""
    spec = importlib.util.spec_from_file_location("round_bench", ROOT / "benchmarks" / "round.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default=None, metavar="REF", help="a commit to run side by side (a worktree)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the figures as flat keys")
    a = ap.parse_args()
    with contextlib.ExitStack() as stack:
        trees = {"current": ROOT}
        if a.baseline:
            trees = {"baseline": stack.enter_context(round_bench().baseline_tree(a.baseline, "command_start.py")),
                     **trees}
        store = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="refinery-command-start-"))) / "store"
        print(f"setup: a tiny run in {store} ...", flush=True)
        setup(store, trees)
        times = {(arm, name): [] for arm in trees for name in COMMANDS}
        for rep in range(a.repeats):
            for arm in (list(trees) if rep % 2 == 0 else list(reversed(trees))):
                for name in COMMANDS:
                    times[arm, name].append(timed(trees[arm], store, name))
            print(f"repeat {rep}: " + "; ".join(f"{arm} " + ", ".join(f"{name} {times[arm, name][-1]:.1f} s"
                                                                      for name in COMMANDS) for arm in trees),
                  flush=True)
    figures = {}
    for (arm, name), v in times.items():
        prefix = "baseline_" if arm == "baseline" else ""
        figures |= {f"{prefix}{name}_s": statistics.median(v), f"{prefix}{name}_min_s": min(v),
                    f"{prefix}{name}_max_s": max(v)}
    for name in COMMANDS:
        line = (f"{name}: {figures[f'{name}_s']:.1f} s (min {figures[f'{name}_min_s']:.1f}, "
                f"max {figures[f'{name}_max_s']:.1f})")
        if a.baseline:
            saved = [b - c for b, c in zip(times["baseline", name], times["current", name])]
            figures[f"{name}_saved_s"] = statistics.median(saved)
            line += (f" against {a.baseline}'s {figures[f'baseline_{name}_s']:.1f} s (min "
                     f"{figures[f'baseline_{name}_min_s']:.1f}, max {figures[f'baseline_{name}_max_s']:.1f}); saved "
                     f"{figures[f'{name}_saved_s']:.1f} s (min {min(saved):.1f}, max {max(saved):.1f})")
        print(line)
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=1))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
