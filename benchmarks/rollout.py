"""Rollout benchmark: useful tokens/s of the transformers backend against named baselines, side by side.

Same prompts (the default pool's first --prompts questions, chat-templated), same G, temperature, max new
tokens and seed, same batch size (rows decoded together):

- baseline "naive": `model.generate` over fixed batches in the prompts' given order (no length sorting),
  fp32, every row kept until the batch's longest row ends. Useful tokens = tokens up to end-of-sequence.
- ours: `TransformersBackend.generate` (length-sorted, one prefill per prompt, finished rows leave the
  batch; dtype auto = bf16 weights where the CPU computes bf16 natively, else fp32).
- ceiling: `model.generate` with the length forced to max_new_tokens (no early stop, so no row idles): with
  bf16 weights (where native), in bf16 autocast over fp32 weights, and in fp32. Every token counts as useful.
On a CPU without native bf16 (AVX2) the bf16 arms are left out: bf16 is emulated there (about 2.5x slower than
fp32), so they bound nothing, and "ours with fp32 weights + autocast" is then ours itself. The ceiling is the
fp32 one.
Targets: ours / naive >= 1.5; ours / the bf16 ceiling >= 1.0 (issue 14). Medians over --repeats.
`--json PATH` writes the figures as flat keys (rollout_useful_tok_s, rollout_ratio_vs_naive,
rollout_ratio_vs_ceiling, ...).

With --run-rss, also runs a default `refinery run` under /usr/bin/time -v and reports its peak RSS
(target < 6 GiB).

    python benchmarks/rollout.py [--prompts 16] [--group 8] [--batch 64] [--repeats 3] [--run-rss] [--json PATH]
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run as a script, this folder's select.py would shadow the standard library's `select`
import argparse  # noqa: E402
import contextlib  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from flows.config import RunConfig  # noqa: E402
from models.backend import Sampling  # noqa: E402
from models.devices import (
    bf16_chosen,  # noqa: E402
    native_bf16,  # noqa: E402
)
from models.hf import cascade  # noqa: E402
from models.hf.backend import TransformersBackend, decode_attention_paths  # noqa: E402
from models.registry import resolve  # noqa: E402
from tasks.ingest import load_source  # noqa: E402


def default_prompts(k: int, instruction: str) -> list[str]:
    rows = []
    for spec in RunConfig().pool.sources:
        rows += load_source(spec.source, spec.size, 0, dict(spec.params))[0]
    step = max(1, len(rows) // k)  # spread over sources
    return [f"{r.text}\n{instruction}" for r in rows[::step][:k]]


def naive(model, tok, prompts: list[str], n: int, s: Sampling, batch: int, forced: bool = False,
          bf16: bool = False) -> int:
    """model.generate over fixed batches of `batch` rows; returns useful tokens. Where a backend or
    `forced_rate` installed models/hf/cascade.py's SDPA wrapper, a bf16 decode step attends as the sampler's own
    steps do on this CPU (in float32 without AMX, torch's SDPA with it: models/hf/backend.py decode_attention_paths)."""
    rows = [p for p in prompts for _ in range(n)]
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    torch.manual_seed(s.seed)
    useful = 0
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    _, float32_attention = decode_attention_paths("cpu", bf16=True)  # the sampler's bf16 steps on this CPU
    for i in range(0, len(rows), batch):
        enc = tok(rows[i : i + batch], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad(), ctx, cascade.float32_decode_steps(float32_attention):
            out = model.generate(**enc, do_sample=True, temperature=s.temperature, top_p=s.top_p,
                                 max_new_tokens=s.max_new_tokens, min_new_tokens=s.max_new_tokens if forced else 0,
                                 pad_token_id=tok.pad_token_id)
        for seq in out[:, enc["input_ids"].shape[1] :].tolist():
            if forced:
                useful += len(seq)
                continue
            cut = next((j for j, t in enumerate(seq) if t in eos), None)
            useful += len(seq) if cut is None else cut
    return useful


def forced_rate(policy: str, prompts: list[str], n: int, max_new_tokens: int, dtype: str = "auto",
                batch: int = 32) -> float:
    """Tokens/s of `model.generate` with the length forced to max_new_tokens (no early stop), bf16 weights where
    `dtype` picks them (as the sampler does): the decode ceiling benchmarks/round.py holds collect against.
    Its attention is the sampler's (models/hf/cascade.py's SDPA wrapper, so a bf16 decode step attends in float32
    where the sampler's do, `naive`, and grouped-query K/V are not repeated): the ceiling differs from the
    sampler in the decode loop, not in the attention kernel (up to edfe522 round.py's ceiling ran torch's bf16
    SDPA, as no backend had been built in its process)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.hf.backend import sdpa_native_gqa

    sdpa_native_gqa("cpu")
    cascade.install()

    bf16 = bf16_chosen("cpu", dtype)
    model = AutoModelForCausalLM.from_pretrained(resolve(policy), dtype=torch.bfloat16 if bf16 else torch.float32)
    tok = AutoTokenizer.from_pretrained(resolve(policy))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    s = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens, seed=0)
    seconds, tokens = timed(lambda: naive(model.eval(), tok, prompts, n, s, batch, forced=True), 1)
    return tokens / seconds


def timed(fn, repeats: int) -> tuple[float, int]:
    times, toks = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        toks = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), toks


def peak_rss_of_default_run() -> str:
    with tempfile.TemporaryDirectory() as d:
        cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "flows.cli", "run", "--store", d, "--run-id", "rss"]
        p = subprocess.run(cmd, capture_output=True, text=True)
        m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
        wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", p.stderr)
        if p.returncode != 0 or not m:
            return f"refinery run failed (exit {p.returncode}): {p.stderr[-500:]}"
        gib = int(m.group(1)) / 2**20
        return f"peak RSS {gib:.2f} GiB (target < 6 GiB: {'ok' if gib < 6 else 'MISS'}), wall {wall.group(1)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--run-rss", action="store_true")
    ap.add_argument("--json", help="write the figures here as flat keys")
    a = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    cfg = RunConfig()
    from transformers import AutoModelForCausalLM

    ours = TransformersBackend(resolve("default"), dtype="auto", batch_size=a.batch)
    tok = ours.tokenizer
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(resolve("default"), dtype=torch.float32).eval()  # the baselines'
    native = native_bf16("cpu")
    prompts = [ours.render([{"role": "user", "content": q}]) for q in default_prompts(a.prompts, cfg.rollout.instruction)]
    s = Sampling(temperature=cfg.rollout.temperature, max_new_tokens=a.max_new_tokens, seed=0)
    print(f"{len(prompts)} prompts x G={a.group}, batch {a.batch} rows, max_new_tokens {a.max_new_tokens}, "
          f"T={s.temperature}; {torch.get_num_threads()} threads; native bf16: {native}; "
          f"ours: {next(ours.model.parameters()).dtype} weights")
    if not native:
        print("no native bf16: the bf16 arms are left out (emulated bf16 bounds nothing); the ceiling is fp32")

    # the decoder as it was before issue 14: bf16 autocast over fp32 weights (a model handed in keeps its dtype)
    before = TransformersBackend(resolve("default"), dtype="bf16", batch_size=a.batch, model=model,
                                 tokenizer=tok) if native else None

    def run_ours() -> int:
        return sum(c.n_tokens for g in ours.generate(prompts, a.group, s) for c in g)

    def run_before() -> int:
        return sum(c.n_tokens for g in before.generate(prompts, a.group, s) for c in g)

    results = {
        "naive model.generate fp32": timed(lambda: naive(model, tok, prompts, a.group, s, a.batch), a.repeats),
        "ours (TransformersBackend)": timed(run_ours, a.repeats),
    }
    if native:
        bf16_model = AutoModelForCausalLM.from_pretrained(resolve("default"), dtype=torch.bfloat16).eval()
        results["ours, fp32 weights + autocast"] = timed(run_before, a.repeats)
        results["ceiling: forced length bf16"] = timed(
            lambda: naive(bf16_model, tok, prompts, a.group, s, a.batch, True), 1)
        results["ceiling: forced bf16 autocast"] = timed(
            lambda: naive(model, tok, prompts, a.group, s, a.batch, True, True), 1)
    results["ceiling: forced length fp32"] = timed(lambda: naive(model, tok, prompts, a.group, s, a.batch, True), 1)
    rate = {k: toks / t for k, (t, toks) in results.items()}
    for k, (t, toks) in results.items():
        print(f"{k:<30} {t:8.1f} s  {toks:>7,} useful tokens  {rate[k]:8.1f} tokens/s")
    base, mine = rate["naive model.generate fp32"], rate["ours (TransformersBackend)"]
    print(f"ratio ours / naive: {mine / base:.2f}x (target >= 1.5x: {'ok' if mine / base >= 1.5 else 'MISS'})")
    ceilings = [k for k in rate if k.startswith("ceiling")]
    for k in ceilings:
        print(f"ours as a fraction of {k}: {mine / rate[k]:.2f}")
    ceiling = rate["ceiling: forced length bf16" if native else "ceiling: forced length fp32"]
    figures = {"rollout_useful_tok_s": mine, "rollout_naive_tok_s": base, "rollout_ratio_vs_naive": mine / base,
               "rollout_ceiling_tok_s": ceiling, "rollout_ratio_vs_ceiling": mine / ceiling,
               "native_bf16": native, "prompts": len(prompts), "group": a.group,
               "max_new_tokens": a.max_new_tokens, "repeats": a.repeats}
    if native:
        print(f"ratio ours / the same decoder with fp32 weights + autocast: "
              f"{mine / rate['ours, fp32 weights + autocast']:.2f}x")
        figures["rollout_ratio_vs_autocast_ceiling"] = mine / rate["ceiling: forced bf16 autocast"]
        figures["rollout_ratio_vs_autocast_decoder"] = mine / rate["ours, fp32 weights + autocast"]
    if a.run_rss:
        print("default refinery run:", peak_rss_of_default_run())
    if a.json:
        import json

        with open(a.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
