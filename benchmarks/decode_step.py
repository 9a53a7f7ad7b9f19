"""One decode step of the embedded policy with bf16 weights, with and without the two bf16 decode paths, side by
side in one process: the attention in float32 (models/hf/decode_attention.py) and oneDNN's packed bf16 linears
(models/hf/packed.py). The baseline arm ("neither") is the decoder as it was before them: torch's SDPA over the
bf16 cache and `F.linear` over the bf16 weights.

    python benchmarks/decode_step.py [--rows 1,8,32] [--context 300] [--steps 24] [--repeats 4] [--json PATH]

Kernels first: one layer's attention call (SmolLM2's 9 query heads over 3 KV heads of 64 dims, `--context`
cached tokens in a buffer with spare columns, as the decode batch hands them) through bf16 SDPA and through
`decode_attention.attend`, and each linear shape of the model (and the 49,152-wide output layer) through
`F.linear` and the packed product, microseconds per call (median of 5 blocks, as decode_attention.py times).

Then the decoder: `generate_ids` of `--rows` prompts of `--context` tokens, end-of-sequence disabled so every
row decodes `--steps` tokens, timing each decode step's forward (one token per row). The four arms (both paths,
attention only, packed only, neither) switch in the same loaded model and alternate `--repeats` times, so the
machine's drift reaches every arm alike; each arm's figure is the median over its repeats of the median step.
The decoder itself runs `both` on a CPU without AMX and `packed` with AMX (models/hf/backend.py), as the run prints.
The machine this runs on is shared: read the spread (min-max over repeats), not one run.

Figures (--json, flat keys): attn_sdpa_us_rows<R>, attn_cast_us_rows<R>, linear_<out>x<in>_us_rows<R> and
linear_<out>x<in>_packed_us_rows<R>, and per rows R and arm A (both, attention, packed, neither):
step_ms_<A>_rows<R>, step_ms_<A>_rows<R>_min, step_ms_<A>_rows<R>_max, and step_speedup_rows<R> (neither /
both). Needs a CPU with native bf16 (AVX512_BF16 or AMX): elsewhere the policy decodes in fp32, where neither
path applies, and it says so and stops.
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
import time  # noqa: E402
from pathlib import Path  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M
LINEARS = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]  # q/o, k/v, gate/up, down, output


@functools.cache
def sibling_timing():
    """benchmarks/decode_attention.py's `timed` (loaded once: this folder is not a package)."""
    spec = importlib.util.spec_from_file_location("decode_attention_bench", Path(__file__).with_name("decode_attention.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench.timed


def per_call_us(f, calls: int) -> float:
    """Microseconds per call: decode_attention.py's timing (the median of 5 blocks of calls // 5, after 10
    warm-up calls)."""
    return sibling_timing()(f, calls) * 1e3


def kernels(rows: list[int], context: int) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    from models.hf import decode_attention, packed

    figures: dict[str, float] = {}
    gen = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    for r in rows:
        k = torch.randn(r, KV_HEADS, context + 64, HEAD_DIM, generator=gen).to(bf)[:, :, :context]
        v = torch.randn(r, KV_HEADS, context + 64, HEAD_DIM, generator=gen).to(bf)[:, :, :context]
        q = torch.randn(r, HEADS, 1, HEAD_DIM, generator=gen).to(bf)
        mask = torch.ones(r, 1, 1, context, dtype=torch.bool)
        with torch.no_grad():
            sdpa = per_call_us(lambda q=q, k=k, v=v, m=mask: F.scaled_dot_product_attention(
                q, k, v, attn_mask=m, enable_gqa=True), 200)
            cast = per_call_us(lambda q=q, k=k, v=v, m=mask: decode_attention.attend(q, k, v, m, HEAD_DIM ** -0.5), 200)
        figures |= {f"attn_sdpa_us_rows{r}": sdpa, f"attn_cast_us_rows{r}": cast}
        print(f"attention, {r} rows x {context} cached tokens: bf16 SDPA {sdpa:.0f} us, float32 cast {cast:.0f} us "
              f"per layer call ({sdpa / cast:.2f}x)")
        for out_f, in_f in LINEARS:
            w = torch.randn(out_f, in_f, generator=gen).to(bf)
            x = torch.randn(r, in_f, generator=gen).to(bf)
            pw = packed.pack_weight(w)
            calls = 40 if out_f > 10_000 else 200
            with torch.no_grad():
                plain = per_call_us(lambda x=x, w=w: F.linear(x, w), calls)
                fast = per_call_us(lambda x=x, pw=pw: packed.packed_linear(x, pw, None), calls)
            figures |= {f"linear_{out_f}x{in_f}_us_rows{r}": plain, f"linear_{out_f}x{in_f}_packed_us_rows{r}": fast}
            print(f"  linear {out_f} x {in_f}, {r} rows: F.linear {plain:.0f} us, packed {fast:.0f} us "
                  f"({plain / fast:.2f}x)")
    return figures


def in_decoder(rows: list[int], context: int, steps: int, repeats: int) -> dict[str, float]:
    from models.backend import Sampling
    from models.hf import packed
    from models.registry import load_backend

    b = load_backend("default")
    b.eos_ids = [-1]  # no row stops early: every row decodes `steps` tokens
    times: list[float] = []
    forward = b.model.forward

    def timed_forward(*args, **kwargs):
        t0 = time.perf_counter()
        out = forward(*args, **kwargs)
        if kwargs["input_ids"].shape[1] == 1:  # a decode step, not a prefill
            times.append(time.perf_counter() - t0)
        return out

    b.model.forward = timed_forward
    chosen, max_rows = b.float32_decode_attention, packed.MAX_ROWS
    print(f"this CPU's decoder runs the arm {'both' if chosen else 'packed'}", flush=True)
    arms = {"both": (True, max_rows), "attention": (True, 0), "packed": (False, max_rows), "neither": (False, 0)}
    figures: dict[str, float] = {}
    try:
        for r in rows:
            ids = [[(i * 7 + j) % 20_000 + 100 for j in range(context)] for i in range(r)]
            b.generate_ids(ids[:1], 1, Sampling(1.0, 1.0, 4, 0))  # warm-up
            medians: dict[str, list[float]] = {a: [] for a in arms}
            for rep in range(repeats):
                for arm in (list(arms) if rep % 2 == 0 else list(arms)[::-1]):
                    b.float32_decode_attention, packed.MAX_ROWS = arms[arm]
                    times.clear()
                    b.generate_ids(ids, 1, Sampling(1.0, 1.0, steps, rep))
                    medians[arm].append(statistics.median(times[2:]) * 1e3)
            for arm, ms in medians.items():
                figures |= {f"step_ms_{arm}_rows{r}": statistics.median(ms), f"step_ms_{arm}_rows{r}_min": min(ms),
                            f"step_ms_{arm}_rows{r}_max": max(ms)}
            speedup = figures[f"step_ms_neither_rows{r}"] / figures[f"step_ms_both_rows{r}"]
            figures[f"step_speedup_rows{r}"] = speedup
            print(f"decode step, {r} rows x {context} tokens of context: " + ", ".join(
                f"{arm} {statistics.median(ms):.1f} ms ({min(ms):.0f}-{max(ms):.0f})" for arm, ms in medians.items())
                + f"; {speedup:.2f}x over neither", flush=True)
    finally:
        b.float32_decode_attention, packed.MAX_ROWS = chosen, max_rows
    return figures


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32", help="rows per decode step, comma-separated")
    ap.add_argument("--context", type=int, default=300, help="cached tokens per row")
    ap.add_argument("--steps", type=int, default=24, help="decode steps per generate call")
    ap.add_argument("--repeats", type=int, default=4, help="generate calls per arm, alternating")
    ap.add_argument("--json", help="write the figures as flat keys")
    a = ap.parse_args()
    from models.devices import native_bf16
    from models.threads import claim

    if not native_bf16("cpu"):
        sys.exit("decode_step: this CPU has no native bf16 (AVX512_BF16 or AMX): the policy decodes in fp32, "
                 "where neither bf16 decode path applies")
    claim()
    rows = [int(x) for x in a.rows.split(",")]
    figures = kernels(rows, a.context) | in_decoder(rows, a.context, a.steps, a.repeats)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(figures, f, indent=1)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
