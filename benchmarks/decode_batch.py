"""Continuous batching's bookkeeping: `TransformersBackend.generate` over a real round's prompts in this checkout
and in a git worktree of --baseline, side by side, with the time spent dropping finished rows
(`DecodeBatch.select`) and merging prefilled prompts (`DecodeBatch.merge`) measured apart.

Input: a store a run has written (`refinery run` or `make demo`); the prompts are the distinct rendered
prompts of one round's rollouts (--round, default 0), sampled as the collect stage does: --group samples
each, --max-new-tokens, T = 0.7, keyed seeds (one per prompt), so both arms draw the same tokens unless their
decoders differ in float rounding (the script prints both arms' token counts). Each arm runs in a child
process over its own tree (--model, the embedded one by default: fp32 on a CPU without native bf16); the arms alternate
--repeats times, the order swapped every repeat, so load that drifts over the run does not favour one.

    python benchmarks/decode_batch.py --store PATH [--run-id demo] [--round 0] [--baseline REF] [--model default]
        [--group 8] [--max-new-tokens 64] [--repeats 3] [--json PATH]

Figures (--json, flat keys): decode_batch_s, decode_batch_select_s, decode_batch_merge_s, decode_batch_tokens,
the same with a `baseline_` prefix (medians over the repeats), decode_batch_speedup (the median of the
repeats' baseline / current ratios) with its min and max, decode_batch_prompts.
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run as a script, this folder's select.py would shadow the standard library's `select`
import argparse  # noqa: E402
import functools  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MARK = "DECODE_BATCH_JSON "


def round_prompts(store: str, run_id: str, rnd: int) -> list[str]:
    """The distinct rendered prompts of one round's rollouts, read straight from the Parquet files (so any
    commit's tree reads them alike)."""
    import duckdb

    files = sorted(str(p) for p in Path(store, "rollouts").rglob("*.parquet"))
    if not files:
        raise SystemExit(f"decode_batch: no rollouts under {store}")
    rows = duckdb.connect().execute(
        "select distinct prompt_text from read_parquet(?, union_by_name = true) where run_id = ? and round = ? "
        "order by prompt_text", [files, run_id, rnd]).fetchall()
    if not rows:
        raise SystemExit(f"decode_batch: no rollouts of run {run_id!r} round {rnd} in {store}")
    return [r[0] for r in rows]


def child(args: dict) -> None:
    """One arm, one repeat: generate over the prompts in this interpreter's tree, timed; one JSON line."""
    import tasks
    from models.backend import Sampling
    from models.hf import decoding
    from models.hf.backend import TransformersBackend
    from models.registry import resolve

    prompts = round_prompts(args["store"], args["run_id"], args["round"])
    backend = TransformersBackend(resolve(args["model"]), batch_size=64)
    spent = {"select": 0.0, "merge": 0.0}
    for name in spent:
        method = getattr(decoding.DecodeBatch, name)

        def timed(self, *a, _method=method, _name=name, **kw):
            t = time.perf_counter()
            try:
                return _method(self, *a, **kw)
            finally:
                spent[_name] += time.perf_counter() - t

        setattr(decoding.DecodeBatch, name, timed)
    t = time.perf_counter()
    out = backend.generate(prompts, args["group"], Sampling(0.7, 1.0, args["max_new_tokens"], 0),
                           row_seeds=list(range(len(prompts))))
    seconds = time.perf_counter() - t
    tokens = sum(len(c.token_ids) + (c.finish_reason == "stop") for g in out for c in g)
    print(MARK + json.dumps({"tree": os.path.dirname(os.path.abspath(tasks.__path__[0])), "seconds": seconds,
                             "tokens": tokens, "select_s": spent["select"], "merge_s": spent["merge"],
                             "prompts": len(prompts)}), flush=True)


@functools.cache
def round_bench():
    """benchmarks/round.py as a module (benchmarks/ is not a package): its worktree and child-result helpers."""
    spec = importlib.util.spec_from_file_location("round_bench", ROOT / "benchmarks" / "round.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_arm(tree: Path, args: dict, label: str) -> dict:
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(args)], cwd=tree,
                          env={**os.environ, "PYTHONPATH": str(tree)}, text=True, capture_output=True)
    out = round_bench().arm_result(proc, MARK, tree, label, "decode_batch.py")
    print(f"  [{label}] {out['seconds']:.1f} s, {out['tokens']} tokens, dropping rows {out['select_s']:.2f} s, "
          f"merging {out['merge_s']:.2f} s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", help="a store a run has written")
    ap.add_argument("--run-id", default="demo")
    ap.add_argument("--round", type=int, default=0)
    ap.add_argument("--baseline", default="4973777", help="the commit to compare with (default: the one before "
                    "rows moved in place)")
    ap.add_argument("--model", default="default", help="the policy spec (round 0: the embedded base)")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the figures here as flat keys")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(json.loads(a.child))
    if not a.store:
        ap.error("--store is required")
    args = {"store": str(Path(a.store).resolve()), "run_id": a.run_id, "round": a.round, "model": a.model,
            "group": a.group, "max_new_tokens": a.max_new_tokens}
    print(f"{len(round_prompts(args['store'], a.run_id, a.round))} prompts x {a.group} samples, "
          f"{a.max_new_tokens} new tokens; baseline {a.baseline}")
    runs: dict[str, list[dict]] = {"current": [], "baseline": []}
    with round_bench().baseline_tree(a.baseline, "decode_batch.py") as tree:
        trees = {"current": ROOT, "baseline": tree}
        for rep in range(a.repeats):
            for arm in (("current", "baseline") if rep % 2 == 0 else ("baseline", "current")):
                runs[arm].append(run_arm(trees[arm], args, arm if arm == "current" else f"baseline {a.baseline}"))
    figures: dict = {"baseline_ref": a.baseline, "decode_batch_prompts": runs["current"][0]["prompts"]}
    for arm, prefix in (("current", ""), ("baseline", "baseline_")):
        for key, name in (("seconds", "s"), ("select_s", "select_s"), ("merge_s", "merge_s"), ("tokens", "tokens")):
            figures[f"{prefix}decode_batch_{name}"] = statistics.median(r[key] for r in runs[arm])
        secs = [r["seconds"] for r in runs[arm]]
        print(f"{arm:>9}: {statistics.median(secs):.1f} s (min {min(secs):.1f}, max {max(secs):.1f}); dropping rows "
              f"{figures[f'{prefix}decode_batch_select_s']:.2f} s, merging {figures[f'{prefix}decode_batch_merge_s']:.2f} s"
              f" (medians); tokens {sorted({r['tokens'] for r in runs[arm]})}")
    ratios = [b["seconds"] / c["seconds"] for c, b in zip(runs["current"], runs["baseline"])]
    figures |= {"decode_batch_speedup": statistics.median(ratios), "decode_batch_speedup_min": min(ratios),
                "decode_batch_speedup_max": max(ratios)}
    print(f"decode_batch_speedup (baseline / current, median of the repeats' ratios) = "
          f"{figures['decode_batch_speedup']:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(figures, f, indent=1)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
