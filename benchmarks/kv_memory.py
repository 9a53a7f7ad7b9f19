"""KV-cache budget benchmark: peak RSS and time of LoPE's long-prompt decoding, bounded against unbounded.

LoPE (tasks/core/lope.py) resamples an all-fail group under P Lorem-Ipsum system prefixes of 100-300 words
(220-660 tokens for SmolLM2's tokenizer), S samples each: the longest prompts a round decodes. The workload
is the default round's: --groups questions of the default pool x --prefixes prefixes x --samples samples,
64 new tokens at most, T = 0.7, keyed seeds, batch 64 rows, the embedded default policy (bf16 weights where the
CPU computes bf16, else fp32).

Each setting runs in its own child process, so its peak RSS (VmHWM) is its own: `--budgets` lists
`kv_cache_gib` values, and `none` is the decoder before the budget (every setting's budget above what the
batch could hold: 64 rows at once). Both decode the same rows; the script checks that they drew the same
tokens. Reports per setting: peak RSS, the peak above the loaded model (the decoding's own share), seconds,
tokens/s, and against `none` the ratio of each. Medians over --repeats (each repeat a fresh child per setting,
settings interleaved).

    python benchmarks/kv_memory.py [--budgets none 1.0] [--repeats 1] [--json PATH]
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run as a script, this folder's select.py would shadow the standard library's `select`
import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

UNBOUNDED_GIB = 1e6


def vm_gib(key: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError(f"{key} not in /proc/self/status")


def child(budget: str, groups: int, prefixes: int, samples: int) -> dict:
    """One setting in this process: load, decode, report (printed as one JSON line)."""
    from flows.config import RunConfig
    from models.backend import Sampling
    from models.hf.backend import TransformersBackend
    from models.registry import resolve
    from tasks.core.fewshot import ask
    from tasks.core.lope import lorem_prefixes
    from tasks.ingest import load_source

    gib = UNBOUNDED_GIB if budget == "none" else float(budget)
    b = TransformersBackend(resolve("default"), batch_size=64, kv_cache_gib=gib)
    cfg = RunConfig()
    spec = cfg.pool.sources[0]
    questions = load_source(spec.source, groups, 0, dict(spec.params))[0]
    prompts = [b.render([{"role": "system", "content": p}, ask(q.text, cfg.rollout.instruction)])
               for q in questions for p in lorem_prefixes(prefixes, 0)]
    loaded = vm_gib("VmRSS")
    t0 = time.perf_counter()
    out = b.generate(prompts, samples, Sampling(cfg.rollout.temperature, 1.0, cfg.rollout.max_new_tokens, 1),
                     row_seeds=list(range(len(prompts))))
    seconds = time.perf_counter() - t0
    ids = [c.token_ids for g in out for c in g]
    return {"budget": budget, "peak_gib": vm_gib("VmHWM"), "loaded_gib": loaded, "seconds": seconds,
            "tokens": sum(len(t) for t in ids), "prompt_tokens_max": max(len(p) for p in b.encode(prompts)),
            "kv_bytes_per_token": b.kv_bytes_per_token,
            "digest": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budgets", nargs="+", default=["none", "1.0"], help="kv_cache_gib values; none = unbounded")
    ap.add_argument("--groups", type=int, default=4, help="all-fail groups resampled (lope_max_groups)")
    ap.add_argument("--prefixes", type=int, default=6, help="Lorem-Ipsum prefixes per group (lope_prefixes)")
    ap.add_argument("--samples", type=int, default=4, help="samples per prefix (lope_samples)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", help="write the figures here as flat keys")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(a.child, a.groups, a.prefixes, a.samples)), flush=True)
        return
    runs: dict[str, list[dict]] = {b: [] for b in a.budgets}
    for rep in range(a.repeats):
        for budget in a.budgets:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", budget, "--groups", str(a.groups),
                   "--prefixes", str(a.prefixes), "--samples", str(a.samples)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"kv_memory: the {budget} child failed: {done.stderr.strip().splitlines()[-1:]}")
            runs[budget].append(json.loads(line[len("RESULT "):]))
            r = runs[budget][-1]
            print(f"repeat {rep}, kv_cache_gib {budget}: peak {r['peak_gib']:.2f} GiB "
                  f"({r['peak_gib'] - r['loaded_gib']:.2f} above the loaded model), {r['seconds']:.1f} s, "
                  f"{r['tokens'] / r['seconds']:.1f} tokens/s", flush=True)
    first = runs[a.budgets[0]][0]
    print(f"{a.groups} groups x {a.prefixes} prefixes x {a.samples} samples, prompts up to "
          f"{first['prompt_tokens_max']} tokens, {first['kv_bytes_per_token']} bytes of KV cache per token")
    figures: dict[str, float | str] = {}
    for budget, rs in runs.items():
        key = "unbounded" if budget == "none" else f"gib_{budget.replace('.', '_')}"
        peak = statistics.median(r["peak_gib"] for r in rs)
        seconds = statistics.median(r["seconds"] for r in rs)
        figures.update({f"kv_{key}_peak_rss_gib": peak, f"kv_{key}_peak_rss_min_gib": min(r["peak_gib"] for r in rs),
                        f"kv_{key}_peak_rss_max_gib": max(r["peak_gib"] for r in rs),
                        f"kv_{key}_decode_gib": statistics.median(r["peak_gib"] - r["loaded_gib"] for r in rs),
                        f"kv_{key}_seconds": seconds, f"kv_{key}_tok_s": rs[0]["tokens"] / seconds})
        print(f"kv_cache_gib {budget:>5}: peak RSS median {peak:.2f} GiB (min {min(r['peak_gib'] for r in rs):.2f}, "
              f"max {max(r['peak_gib'] for r in rs):.2f}), {seconds:.1f} s")
    digests = {r["digest"] for rs in runs.values() for r in rs}
    figures["kv_same_tokens"] = "yes" if len(digests) == 1 else "no"
    print("every setting drew the same tokens" if len(digests) == 1 else "THE SETTINGS DREW DIFFERENT TOKENS")
    if "none" in runs:
        base = figures["kv_unbounded_peak_rss_gib"], figures["kv_unbounded_seconds"]
        for budget in a.budgets:
            if budget != "none":
                key = f"gib_{budget.replace('.', '_')}"
                figures[f"kv_{key}_peak_ratio_vs_unbounded"] = figures[f"kv_{key}_peak_rss_gib"] / base[0]
                figures[f"kv_{key}_time_ratio_vs_unbounded"] = figures[f"kv_{key}_seconds"] / base[1]
                print(f"kv_cache_gib {budget} against unbounded: peak RSS x{figures[f'kv_{key}_peak_ratio_vs_unbounded']:.2f}, "
                      f"time x{figures[f'kv_{key}_time_ratio_vs_unbounded']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
