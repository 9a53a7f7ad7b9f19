"""Shaping benchmark: batched MCMC (tasks/core/mcmc.py) on fixed traces, over several chain seeds.

Traces: --traces reference solutions "a * b = c. The answer is \\boxed{c}." for the default pool's 1-digit
products, shaped under --model (the embedded default policy) with the reasoning-gym verifier deciding
membership of C. A chain's randomness (cut points, acceptance uniforms, keyed suffix sampling) comes from its
key, which holds the seed, so each of --seeds seeds is a different, reproducible set of proposals: shaping's
time follows its proposals (a step lasts as long as its longest proposal), and one seed says little.

Two comparisons, each side by side in one run:
- default: batched (one generate and one score call per step for all traces) against the same chains one
  trace at a time. They draw the same randomness, so the script checks that their accept/reject decisions
  agree, and prints how many moves were rejected as irreversible (old suffix longer than --max-new-tokens)
  or as cut by that limit;
- `--baseline REF`: batched shaping of the same traces and seeds in this checkout and in a git worktree of REF
  (each arm in a child process over its own tree, one after the other). Decoders of different commits may
  sample different proposals for the same key, so besides the seconds the script prints each arm's work:
  tokens generated, decode steps (the longest proposal of each step, summed; for chains streamed in one running
  batch, the decode loop's own steps) and the cost of a decode step.
  The step cost compares the decoders; the seconds compare what shaping costs with each commit's sampler.

Medians over the seeds, with the range. --json PATH writes the figures as flat keys: shape_batched_s,
shape_one_at_a_time_s, shape_batched_speedup, shape_decisions_agree, shape_decisions; with --baseline shape_s,
shape_ms_per_decode_step, shape_generated_tokens, shape_decode_steps, the same with a `baseline_` prefix,
shape_ratio_vs_baseline and shape_step_cost_ratio_vs_baseline.

    python benchmarks/shape.py [--traces 16] [--steps 4] [--max-new-tokens 48] [--seeds 3] [--baseline REF]
        [--json PATH]
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
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MARK = "SHAPE_BENCHMARK_JSON "


def make_traces(b, n: int, seed: int) -> list:
    """`n` product traces with reference solutions; chain keys carry `seed`. Only names that every commit
    since the MCMC layer moved to tasks/core has, so a baseline worktree runs it too."""
    from flows.config import RunConfig
    from tasks.core.mcmc import CONTINUE, Trace
    from tasks.core.rewards import verify
    from tasks.ingest import load_source

    spec = RunConfig().pool.sources[0]
    rows = load_source(spec.source, n, 0, dict(spec.params))[0]
    eos = b.eos_ids[0]
    out = []
    for r in rows[:n]:
        x, y = (int(v) for v in re.findall(r"\d+", r.text)[-2:])
        sol = f"{x} * {y} = {r.answer}. The answer is \\boxed{{{r.answer}}}."
        q = f"{r.text}\nPut your final answer within \\boxed{{}}."

        def in_c(ids, r=r):
            text = b.tokenizer.decode([i for i in ids if i != eos], skip_special_tokens=True)
            return verify(text, r.answer, r.source, r.text, r.meta, "auto", False, 0.0).correct

        prompt = b.encode([b.render([{"role": "user", "content": q}])])[0]
        ctx = b.encode([b.render([{"role": "user", "content": f"{q}\n\nReference solution:\n{sol}\n\n{CONTINUE}"}])])[0]
        out.append(Trace(f"bench-{seed}-{r.prompt_id}", prompt, ctx, b.encode([sol])[0] + [eos], in_c))
    return out


def shape_once(b, traces: list, steps: int, variant: str, max_new_tokens: int, batched: bool) -> dict:
    """Shape `traces`, timed; counts the tokens generated and the decode steps (per generate call, its longest
    completion, end of sequence included)."""
    from tasks.core.mcmc import shape_traces

    work = {"generated": 0, "decode_steps": 0}

    def count(out: list) -> None:
        lens = [len(c.token_ids) + (c.finish_reason == "stop") for g in out for c in g]
        work["generated"] += sum(lens)
        work["decode_steps"] += max(lens, default=0)

    def counting(*args, **kw):
        out = orig(*args, **kw)
        count(out)
        return out

    def counting_fused(*args, **kw):  # generate_and_score_ids: (completions, scores), where a commit has it
        out = orig_fused(*args, **kw)
        count(out[0])
        return out

    def counting_states(*args, **kw):  # generate_from_states (chains in lockstep that keep states), where a commit has it
        out = orig_states(*args, **kw)
        count(out)
        return out

    def counting_stream(*args, **kw):  # stream_from_states (streamed chains): its decode steps, not its longest row
        before = b.decode_steps
        out = orig_stream(*args, **kw)
        work["generated"] += sum(len(c.token_ids) + (c.finish_reason == "stop") for c in out)
        work["decode_steps"] += b.decode_steps - before + bool(out)  # the first draw needs no step before it
        return out

    orig, orig_fused = b.generate_ids, getattr(b, "generate_and_score_ids", None)
    orig_states = getattr(b, "generate_from_states", None)
    orig_stream = getattr(b, "stream_from_states", None)
    b.generate_ids = counting
    if orig_fused is not None:
        b.generate_and_score_ids = counting_fused
    if orig_stream is not None:  # generate_from_states runs through it: counted there, once
        b.stream_from_states = counting_stream
    elif orig_states is not None:
        b.generate_from_states = counting_states
    try:
        t0 = time.perf_counter()
        shape_traces(b, traces, steps, variant, max_new_tokens, batched=batched)
        seconds = time.perf_counter() - t0
    finally:
        del b.generate_ids
        if orig_fused is not None:
            del b.generate_and_score_ids
        if orig_stream is not None:
            del b.stream_from_states
        elif orig_states is not None:
            del b.generate_from_states
    return {"seconds": seconds, **work, "decisions": [t.decisions for t in traces],
            "irreversible": sum(t.rejected_irreversible for t in traces),
            "cut": sum(t.rejected_cut for t in traces), "accepted": sum(t.accepted for t in traces)}


def load_model(spec: str):
    from models.hf.backend import TransformersBackend
    from models.registry import resolve

    return TransformersBackend(resolve(spec), batch_size=64)


def child(args: dict) -> None:
    """One baseline-comparison arm: batched shaping per seed in this interpreter's tree; one JSON line."""
    import tasks

    b = load_model(args["model"])
    runs = []
    for seed in range(args["seeds"]):
        r = shape_once(b, make_traces(b, args["traces"], seed), args["steps"], args["variant"],
                       args["max_new_tokens"], batched=True)
        print(f"  seed {seed}: {r['seconds']:.1f} s, {r['generated']} tokens generated over {r['decode_steps']} "
              f"decode steps, {r['accepted']} accepted", flush=True)
        runs.append({k: v for k, v in r.items() if k != "decisions"})
    print(MARK + json.dumps({"tree": os.path.dirname(os.path.abspath(tasks.__path__[0])), "runs": runs}), flush=True)


@functools.cache
def round_bench():
    """benchmarks/round.py as a module (benchmarks/ is not a package): its worktree and child-result helpers."""
    spec = importlib.util.spec_from_file_location("round_bench", ROOT / "benchmarks" / "round.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_arm(tree: Path, args: dict, label: str) -> list[dict]:
    print(f"[{label}] batched shaping in {tree} ...", flush=True)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(args)], cwd=tree,
                          env={**os.environ, "PYTHONPATH": str(tree)}, text=True, capture_output=True)
    print("\n".join(ln for ln in proc.stdout.splitlines() if not ln.startswith(MARK)), flush=True)
    return round_bench().arm_result(proc, MARK, tree, label, "shape.py")["runs"]


def spread(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.1f} (range {min(xs):.1f}-{max(xs):.1f})"


def against_baseline(a: argparse.Namespace, args: dict) -> dict:
    round_bench().check_commit(a.baseline, "shape.py")  # before the current arm spends its minutes
    arms = {"current": run_arm(ROOT, args, "current")}
    with round_bench().baseline_tree(a.baseline, "shape.py") as tree:
        arms["baseline"] = run_arm(tree, args, f"baseline {a.baseline}")
    figures: dict = {"baseline_ref": a.baseline}
    for name, runs in arms.items():
        prefix = "" if name == "current" else "baseline_"
        secs = [r["seconds"] for r in runs]
        step_ms = [1000 * r["seconds"] / r["decode_steps"] for r in runs if r["decode_steps"]]
        figures |= {f"{prefix}shape_s": statistics.median(secs),
                    f"{prefix}shape_generated_tokens": statistics.median(r["generated"] for r in runs),
                    f"{prefix}shape_decode_steps": statistics.median(r["decode_steps"] for r in runs),
                    f"{prefix}shape_ms_per_decode_step": statistics.median(step_ms) if step_ms else None}
        print(f"{name:>9}: seconds {spread(secs)}; tokens generated "
              f"{spread([r['generated'] for r in runs])}; decode steps {spread([r['decode_steps'] for r in runs])}"
              + (f"; ms per decode step {spread(step_ms)}" if step_ms else ""))
    figures["shape_ratio_vs_baseline"] = figures["shape_s"] / figures["baseline_shape_s"]
    if figures["shape_ms_per_decode_step"] and figures["baseline_shape_ms_per_decode_step"]:
        figures["shape_step_cost_ratio_vs_baseline"] = (figures["shape_ms_per_decode_step"]
                                                       / figures["baseline_shape_ms_per_decode_step"])
    print(f"current / baseline {a.baseline}: seconds {figures['shape_ratio_vs_baseline']:.2f}"
          + (f", cost of a decode step {figures['shape_step_cost_ratio_vs_baseline']:.2f}"
             if "shape_step_cost_ratio_vs_baseline" in figures else ""))
    return figures


def batched_vs_one_at_a_time(a: argparse.Namespace) -> dict:
    import torch

    b = load_model(a.model)
    print(f"torch threads {torch.get_num_threads()}, {a.traces} traces x {a.steps} steps, variant {a.variant}, "
          f"{a.seeds} seeds")
    runs: dict[str, list[dict]] = {"batched": [], "one_at_a_time": []}
    for seed in range(a.seeds):
        for mode in runs:
            runs[mode].append(shape_once(b, make_traces(b, a.traces, seed), a.steps, a.variant, a.max_new_tokens,
                                         batched=mode == "batched"))
        print(f"seed {seed}: " + ", ".join(f"{k} {v[-1]['seconds']:.1f} s" for k, v in runs.items()), flush=True)
    flat = [(x, y) for rb, ro in zip(runs["batched"], runs["one_at_a_time"])
            for da, db in zip(rb["decisions"], ro["decisions"]) for x, y in zip(da, db)]
    agree = sum(x == y for x, y in flat)
    figures = {}
    for mode, rs in runs.items():
        secs = [r["seconds"] for r in rs]
        figures[f"shape_{mode}_s"] = statistics.median(secs)
        print(f"{mode:>14}: seconds {spread(secs)}, {sum(r['generated'] for r in rs)} tokens generated in all")
    speedups = [o["seconds"] / b_["seconds"] for b_, o in zip(runs["batched"], runs["one_at_a_time"])]
    figures |= {"shape_batched_speedup": statistics.median(speedups), "shape_decisions_agree": agree,
                "shape_decisions": len(flat)}
    print(f"speed-up batched vs one at a time: {spread(speedups)}x")
    print(f"decisions agreeing: {agree} / {len(flat)} (accepted {sum(x for x, _ in flat)}; rejected as "
          f"irreversible {sum(r['irreversible'] for r in runs['batched'])}, as cut by the length limit "
          f"{sum(r['cut'] for r in runs['batched'])})")
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--traces", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--variant", default="mh", choices=["mh", "greedy"])
    ap.add_argument("--seeds", type=int, default=3, help="chain seeds (each a different set of proposals)")
    ap.add_argument("--baseline", default=None, metavar="REF",
                    help="batched shaping in this checkout against a git worktree of REF, instead of batched "
                         "against one trace at a time")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the figures as flat keys")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(json.loads(a.child))
    if a.seeds < 1 or a.traces < 1:
        raise SystemExit("shape.py: --seeds and --traces must be at least 1")
    args = {"model": a.model, "traces": a.traces, "steps": a.steps, "max_new_tokens": a.max_new_tokens,
            "variant": a.variant, "seeds": a.seeds}
    figures = against_baseline(a, args) if a.baseline else batched_vs_one_at_a_time(a)
    if a.json:
        Path(a.json).write_text(json.dumps(figures | {f"config_{k}": v for k, v in args.items()}, indent=1,
                                           sort_keys=True))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
