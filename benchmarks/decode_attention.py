"""A lead, measured: decode-step attention when a group's G samples share their prompt. Not in the decoder yet.

The decoder (models/hf.py) repeats each prompt's KV cache for its G samples and runs torch's SDPA over every
row's whole cache (prompt + own tokens). A cascade (the idea of Hydragen, arXiv 2402.05099, and FlashInfer's
cascade attention) reads each prompt's keys and values once per group: the queries of a group's rows and of a
KV head's query heads attend to the shared prefix as one matrix product, each row attends to its own tokens
apart, and the two softmax parts merge by their log-sum-exp. Same result to float rounding (checked here).

Shapes: --groups prompts x --samples rows each (default 8 x 8, the default rollout batch of 64 rows), SmolLM2's 9
query heads over 3 KV heads of 64 dims, prompts of --prefix tokens and --suffix tokens generated so far, fp32
(what a CPU without bf16 decodes in). Timed per attention call (median of 5 blocks of --calls / 5), the baseline
(the decoder's call: SDPA with `enable_gqa` over a view of a preallocated buffer, as models/decoding.py
BufferedLayer hands it) side by side with the cascade; x 30 layers gives a decode step's share.

    python benchmarks/decode_attention.py [--groups 8] [--samples 8] [--prefix 100,300] [--suffix 20,60]
        [--calls 200] [--json PATH]

Figures (--json, flat keys, per prefix P and suffix S): attn_sdpa_ms_P<P>_S<S>, attn_cascade_ms_P<P>_S<S>,
attn_cascade_speedup_P<P>_S<S>, attn_cascade_max_err_P<P>_S<S>.
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


def cascade(q, kp, vp, ks, vs, groups: int, samples: int):
    """Attention of q [B, H, 1, D] (B = groups x samples, a group's rows together) over its group's prefix
    kp/vp [groups, KV, P, D] and its own tokens ks/vs [B, KV, S, D]."""
    import torch

    b, h, _, d = q.shape
    per_kv = h // KV_HEADS
    scale = d ** -0.5
    qg = q.view(groups, samples, KV_HEADS, per_kv, d).permute(0, 2, 1, 3, 4).reshape(groups, KV_HEADS, -1, d)
    sp = torch.matmul(qg, kp.transpose(-1, -2)) * scale  # [groups, KV, samples x per_kv, P]
    mp = sp.amax(-1, keepdim=True)
    ep = torch.exp(sp - mp)
    lp, op = ep.sum(-1, keepdim=True), torch.matmul(ep, vp)

    def rows(t):  # [groups, KV, samples x per_kv, *] -> [B, KV, per_kv, *]
        return t.view(groups, KV_HEADS, samples, per_kv, -1).permute(0, 2, 1, 3, 4).reshape(b, KV_HEADS, per_kv, -1)

    mp, lp, op = rows(mp), rows(lp), rows(op)
    ss = torch.matmul(q.view(b, KV_HEADS, per_kv, d), ks.transpose(-1, -2)) * scale  # [B, KV, per_kv, S]
    ms = ss.amax(-1, keepdim=True)
    es = torch.exp(ss - ms)
    ls, os_ = es.sum(-1, keepdim=True), torch.matmul(es, vs)
    m = torch.maximum(mp, ms)
    a, c = torch.exp(mp - m), torch.exp(ms - m)
    return ((op * a + os_ * c) / (lp * a + ls * c)).view(b, h, 1, d)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prefix", default="100,300", help="prompt lengths, comma-separated")
    ap.add_argument("--suffix", default="20,60", help="tokens generated so far, comma-separated")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--json", help="write the figures as flat keys")
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F

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

            def casc(q=q, kp=kp, vp=vp, ks=ks, vs=vs):
                return cascade(q, kp, vp, ks, vs, g, n)

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
    if a.json:
        with open(a.json, "w") as f:
            json.dump(figures, f, indent=1)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
