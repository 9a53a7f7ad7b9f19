"""Shaping benchmark: batched MCMC (one generate + one score call per step for all traces) against the same
chains run one trace at a time, side by side, on the same traces and seeds.

Traces: --traces reference solutions "a * b = c. The answer is \\boxed{c}." for the default pool's 1-digit
products, shaped under the embedded default policy with the reasoning-gym verifier deciding membership of C.
Both runs draw the same per-trace randomness (cut points, acceptance uniforms, keyed suffix sampling), so
they should make the same accept/reject decisions; the script prints how many of them agree, and how many
moves were rejected as irreversible (old suffix longer than --max-new-tokens) or as cut by that limit.
Reports proposal tokens/s (tokens generated + tokens scored, per second of wall time) of each, and the ratio
(target >= 4x). Medians over --repeats.

    python benchmarks/shape.py [--traces 16] [--steps 4] [--max-new-tokens 48] [--repeats 3]
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run as a script, this folder's select.py would shadow the standard library's `select`
import argparse  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from models.hf import TransformersBackend  # noqa: E402
from models.registry import resolve  # noqa: E402
from tasks.core.mcmc import CONTINUE, Trace, shape_traces  # noqa: E402
from tasks.core.rewards import verify  # noqa: E402


def make_traces(b: TransformersBackend, n: int) -> list[Trace]:
    from flows.config import RunConfig
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
        out.append(Trace(f"bench-{r.prompt_id}", prompt, ctx, b.encode([sol])[0] + [eos], in_c))
    return out


def work_tokens(traces: list[Trace]) -> int:
    return sum(len(t.ids) for t in traces)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--traces", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--variant", default="mh", choices=["mh", "greedy"])
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    b = TransformersBackend(resolve(a.model), batch_size=64)
    print(f"torch threads {torch.get_num_threads()}, {a.traces} traces x {a.steps} steps, variant {a.variant}")
    times: dict[str, list[float]] = {"batched": [], "one_at_a_time": []}
    toks: dict[str, int] = {}
    decisions: dict[str, list] = {}
    rejected: dict[str, tuple[int, int]] = {}
    for rep in range(a.repeats):
        for mode in ("batched", "one_at_a_time"):
            traces = make_traces(b, a.traces)
            generated = [0]
            orig = b.generate_ids

            def counting(*args, _orig=orig, _generated=generated, **kw):
                out = _orig(*args, **kw)
                _generated[0] += sum(c.n_tokens for g in out for c in g)
                return out

            b.generate_ids = counting
            t0 = time.perf_counter()
            shape_traces(b, traces, a.steps, a.variant, a.max_new_tokens, batched=mode == "batched")
            times[mode].append(time.perf_counter() - t0)
            b.generate_ids = orig
            toks[mode] = generated[0]
            decisions[mode] = [t.decisions for t in traces]
            rejected[mode] = (sum(t.rejected_irreversible for t in traces), sum(t.rejected_cut for t in traces))
        print(f"repeat {rep}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in times.items()))
    flat = [(x, y) for da, db in zip(decisions["batched"], decisions["one_at_a_time"]) for x, y in zip(da, db)]
    agree = sum(x == y for x, y in flat)
    accepted = sum(x for x, _ in flat)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k in med:
        print(f"{k:>14}: median {med[k]:.1f} s, {toks[k]} proposal tokens, {toks[k] / med[k]:.1f} proposal tokens/s")
    print(f"speed-up batched vs one at a time: {med['one_at_a_time'] / med['batched']:.2f}x (target >= 4x)")
    print(f"decisions agreeing: {agree} / {len(flat)} (accepted {accepted}; rejected as irreversible "
          f"{rejected['batched'][0]}, as cut by the length limit {rejected['batched'][1]})")


if __name__ == "__main__":
    main()
