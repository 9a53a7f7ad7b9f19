"""Decode-step attention when a group's G samples share their prompt: SDPA over every row's copy of the prompt
(the baseline) against the cascade (models/hf/cascade.py), as a kernel and in the decoder.

The decoder (models/hf/backend.py) repeats each prompt's KV cache for its G samples; SDPA reads every row's whole cache
(prompt + own tokens). The cascade (the idea of Hydragen, arXiv 2402.05099, and FlashInfer's cascade attention)
reads each prompt's keys and values once per group: the queries of a group's rows and of a KV head's query heads
attend to the shared prefix as one matrix product, each row attends to its own tokens apart, and the two softmax
parts merge by their log-sum-exp. Same result to float rounding (checked here).

Shapes: --groups prompts x --samples rows each (default 8 x 8, the default rollout batch of 64 rows), SmolLM2's 9
query heads over 3 KV heads of 64 dims, prompts of --prefix tokens and --suffix tokens generated so far, fp32
(what a CPU without bf16 decodes in). Timed per attention call (median of 5 blocks of --calls / 5), the baseline
(the decoder's call: SDPA with `enable_gqa` over a view of a preallocated buffer, as models/hf/decoding.py
BufferedLayer hands it) side by side with the cascade; x 30 layers gives a decode step's share.

With --generate, the same comparison in the decoder: the embedded policy's `generate` (the backend's
`shared_prompt_attention` on and off, and with bf16 weights its `float32_decode_attention` on and off too:
models/hf/decode_attention.py; the arms alternate, --repeats each) on the default pool's first 16 questions x
--samples, 64 new tokens at most, T = 0.7, batch 64: once as collect's plain prompts (about 90 tokens), once
with four worked examples (each a sentence of reasoning and the boxed answer) before each question as chat
turns (about 350 tokens: a few-shot prompt). Both
arms sample the same tokens except where float rounding moves a draw across a boundary, after which that row
goes its own way (the share of rows sampled alike is reported; tests/test_cascade.py checks equality on the
tiny model).

    python benchmarks/decode_attention.py [--groups 8] [--samples 8] [--prefix 150,300] [--suffix 20,60]
        [--calls 200] [--generate] [--repeats 2] [--json PATH]

Figures (--json, flat keys, per prefix P and suffix S): attn_sdpa_ms_P<P>_S<S>, attn_cascade_ms_P<P>_S<S>,
attn_cascade_speedup_P<P>_S<S>, attn_cascade_max_err_P<P>_S<S>; with --generate, for the plain and few-shot
prompts: gen_<kind>_sdpa_s, gen_<kind>_cascade_s (medians; with the float32 attention as this CPU's decoder
chooses it), gen_<kind>_cascade_speedup (the median of the repeats' ratios), gen_<kind>_tokens,
gen_<kind>_prompt_tokens (median), gen_<kind>_rows_identical, and per arm A (sdpa, cascade, and with bf16
float32 and cascade_float32) gen_<kind>_<A>_arm_s and gen_<kind>_<A>_arm_vs_chosen (its time over the arm the
decoder runs here: models/hf/backend.py chooses by AMX).
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run as a script, this folder's select.py would shadow the standard library's `select`
import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30  # SmolLM2-135M


def timed(f, calls: int) -> float:
    """Milliseconds per call: the median of 5 blocks of calls // 5, after 10 warm-up calls."""
    for _ in range(10):
        f()
    block = max(1, calls // 5)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(block):
            f()
        times.append((time.perf_counter() - t0) / block * 1e3)
    return statistics.median(times)


def in_decoder(samples: int, repeats: int) -> dict[str, float]:
    """The embedded policy's generate with the cascade on and off, on plain and few-shot prompts."""
    from flows.config import RunConfig
    from models.backend import Sampling
    from models.registry import load_backend
    from tasks.ingest import load_source

    cfg = RunConfig()
    rows = []
    for spec in cfg.pool.sources:
        rows += load_source(spec.source, spec.size, 0, dict(spec.params))[0]
    step = max(1, len(rows) // 20)
    picked = rows[::step][:20]
    questions, demos = picked[:16], picked[16:20]
    b = load_backend("default", batch_size=64)
    reasoning = ("Let me work through this carefully, one step at a time, writing down each intermediate result "
                 "and checking it before moving on, so that no arithmetic slip goes unnoticed. ")
    worked = [m for d in demos for m in ({"role": "user", "content": f"{d.text}\n{cfg.rollout.instruction}"},
                                         {"role": "assistant",
                                          "content": f"{reasoning}The answer is \\boxed{{{d.answer}}}."})]
    kinds = {"plain": [b.render([{"role": "user", "content": f"{q.text}\n{cfg.rollout.instruction}"}])
                       for q in questions],
             "fewshot": [b.render([*worked, {"role": "user", "content": f"{q.text}\n{cfg.rollout.instruction}"}])
                         for q in questions]}
    sampling = Sampling(temperature=cfg.rollout.temperature, max_new_tokens=64, seed=0)
    chosen = (b.shared_prompt_attention, b.float32_decode_attention)  # what this CPU's decoder runs (models/hf/backend.py)
    # (cascade, float32 decode attention); the latter only changes a bf16 cache's steps
    arms = [(c, f) for c in (False, True) for f in ((False, True) if b.bf16 else (False,))]
    name = {(False, False): "sdpa", (True, False): "cascade", (False, True): "float32", (True, True): "cascade_float32"}
    print(f"this CPU's decoder runs the arm {name[chosen]}")
    figures: dict[str, float] = {}
    for kind, prompts in kinds.items():
        ids = b.encode(prompts)
        times: dict[tuple, list[float]] = {a: [] for a in arms}
        tokens: dict[tuple, list] = {}
        for rep in range(repeats):
            for arm in (arms if rep % 2 == 0 else arms[::-1]):
                b.shared_prompt_attention, b.float32_decode_attention = arm
                t0 = time.perf_counter()
                out = b.generate_ids(ids, samples, sampling, row_seeds=list(range(len(ids))))
                times[arm].append(time.perf_counter() - t0)
                tokens[arm] = [c.token_ids for cs in out for c in cs]
        b.shared_prompt_attention, b.float32_decode_attention = chosen
        base = (False, chosen[1])  # the cascade's baseline: SDPA (or the float32 path) over every row's copy
        same = sum(x == y for x, y in zip(tokens[base], tokens[(True, chosen[1])])) / len(tokens[base])
        ratios = [x / y for x, y in zip(times[base], times[(True, chosen[1])])]
        n_tok = sum(len(t) for t in tokens[(True, chosen[1])])
        figures |= {f"gen_{kind}_sdpa_s": statistics.median(times[base]),
                    f"gen_{kind}_cascade_s": statistics.median(times[(True, chosen[1])]),
                    f"gen_{kind}_cascade_speedup": statistics.median(ratios), f"gen_{kind}_tokens": n_tok,
                    f"gen_{kind}_prompt_tokens": statistics.median(len(x) for x in ids),
                    f"gen_{kind}_rows_identical": same}
        for arm in arms:
            figures |= {f"gen_{kind}_{name[arm]}_arm_s": statistics.median(times[arm]),
                        f"gen_{kind}_{name[arm]}_arm_vs_chosen": statistics.median(
                            [x / y for x, y in zip(times[arm], times[chosen])])}
        print(f"generate, {kind} prompts ({statistics.median(len(x) for x in ids):.0f} tokens, {len(ids)} x "
              f"{samples}, {n_tok} tokens): " + ", ".join(
                  f"{name[arm]} {statistics.median(times[arm]):.1f} s ({min(times[arm]):.1f}-{max(times[arm]):.1f})"
                  for arm in arms) + f"; the cascade {statistics.median(ratios):.2f}x over its baseline; rows "
              f"sampled alike {same:.0%}", flush=True)
    return figures


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prefix", default="150,300", help="prompt lengths, comma-separated")
    ap.add_argument("--suffix", default="20,60", help="tokens generated so far, comma-separated")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--generate", action="store_true", help="also compare the two in the decoder's generate")
    ap.add_argument("--repeats", type=int, default=2, help="--generate: runs of each arm")
    ap.add_argument("--json", help="write the figures as flat keys")
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F

    from models.hf.cascade import SharedPrompts
    from models.threads import claim

    claim()
    torch.manual_seed(0)
    g, n = a.groups, a.samples
    rows = g * n
    figures: dict[str, float] = {}
    print(f"{g} prompts x {n} samples = {rows} rows, {HEADS} heads over {KV_HEADS} KV heads, fp32, "
          f"{torch.get_num_threads()} threads")
    for p in (int(x) for x in a.prefix.split(",")):
        for s in (int(x) for x in a.suffix.split(",")):
            kp, vp = torch.randn(g, KV_HEADS, p, HEAD_DIM), torch.randn(g, KV_HEADS, p, HEAD_DIM)
            ks, vs = torch.randn(rows, KV_HEADS, s, HEAD_DIM), torch.randn(rows, KV_HEADS, s, HEAD_DIM)
            q = torch.randn(rows, HEADS, 1, HEAD_DIM)
            width = p + s
            kbuf, vbuf = (torch.empty(rows, KV_HEADS, width + 64, HEAD_DIM) for _ in range(2))  # spare columns
            for buf, pre, own in ((kbuf, kp, ks), (vbuf, vp, vs)):
                buf[:, :, :p] = pre.repeat_interleave(n, 0)
                buf[:, :, p:width] = own
            k, v = kbuf[:, :, :width], vbuf[:, :, :width]
            mask = torch.ones(rows, 1, 1, width, dtype=torch.bool)

            def sdpa(q=q, k=k, v=v, mask=mask):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

            shared = SharedPrompts(n)  # the decoder's own cascade (models/hf/cascade.py), prompts added as a merge does
            shared.add([(kp, vp)], torch.ones(g, p, dtype=torch.bool), shift=0, end=p)
            shared.step(mask[:, 0, 0, :])
            if not shared.active:
                sys.exit(f"decode_attention: {rows} rows over {g} prompts of {p} tokens do not take the cascade "
                         f"(models/hf/cascade.py MIN_*)")

            def casc(q=q, k=k, v=v, shared=shared):
                return shared.attend(0, q, k, v, HEAD_DIM ** -0.5).transpose(1, 2)

            err = (casc() - sdpa()).abs().max().item()
            t_sdpa, t_casc = timed(sdpa, a.calls), timed(casc, a.calls)
            key = f"P{p}_S{s}"
            figures |= {f"attn_sdpa_ms_{key}": t_sdpa, f"attn_cascade_ms_{key}": t_casc,
                        f"attn_cascade_speedup_{key}": t_sdpa / t_casc, f"attn_cascade_max_err_{key}": err}
            print(f"prefix {p}, suffix {s}: SDPA {t_sdpa:.3f} ms, cascade {t_casc:.3f} ms per call "
                  f"({t_sdpa / t_casc:.2f}x; x{LAYERS} layers: {LAYERS * t_sdpa:.0f} vs {LAYERS * t_casc:.0f} ms per "
                  f"decode step), max abs difference {err:.1e}")
            if err > 1e-4:
                sys.exit(f"decode_attention: the cascade differs from SDPA by {err:.2e} at prefix {p}, suffix {s}")
    if a.generate:
        figures |= in_decoder(a.samples, a.repeats)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(figures, f, indent=1)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
