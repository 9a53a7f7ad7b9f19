"""Training benchmark: tokens/s of the GRPO optimizer step against a bare forward/backward/AdamW loop on the
same batch, side by side.

Batch: --rows sequences of the embedded default (or --model) made from real chat-templated default-pool
prompts and --completion-tokens of completion each, with alternating advantages.
- baseline "bare": model(input_ids).logits over the whole sequence -> cross-entropy on the completion
  tokens -> backward -> clip -> AdamW step, in micro-batches of --micro.
- ours, step: `train_round` for one optimizer step with old and reference log-probs already computed, i.e.
  the GRPO loss path (completion-only output layer, clip-higher, k3 KL, entropy, masking) with the same
  micro-batches. Target ratio bare_time / ours_step_time >= 1 / 1.15 (overhead <= 15%).
- ours, round: the whole `train_round`, including recomputing old log-probs and the reference forward
  (two extra forward passes the algorithm needs); reported, not targeted.
Shared prefix (tasks/core/prefix.py): a second batch of --prefix-rows sequences in groups of --group-size
(G = 8) with few-shot prompts like a default round's (solved demonstrations as earlier chat turns, as many as
fit in --prompt-tokens, 250) and --prefix-completion-tokens (40) each; the whole `train_round`
(old and reference log-probs, forward/backward, AdamW) with `shared_prefix` true against false, at the
default micro-batch limits. train_prefix_speedup = unshared time / shared time, the median of the repeats'
ratios (target >= 2.5); the optimizer step alone is reported too.
Both comparisons train one optimizer step, whose rows would take their old log-probs from the step's own
forward by default (`first_step_on_policy`); they run with it off, so the old pass stays in the round as in a
round of several steps and the figures compare with earlier commits' (benchmarks/first_step.py measures it).
Medians over --repeats with min-max spread; every variant starts from the same weights each repeat.
--json PATH writes the figures as flat keys (train_prefix_speedup, train_ratio_vs_bare, ...).

    python benchmarks/train.py [--model default] [--rows 32] [--micro 8] [--completion-tokens 48] [--repeats 3]
        [--prefix-rows 16] [--group-size 8] [--prompt-tokens 250] [--json PATH]
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run as a script, this folder's select.py would shadow the standard library's `select`
import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from models.registry import resolve  # noqa: E402
from tasks.core.grpo import Sequence, TrainConfig, TrainPlan, train_round  # noqa: E402


def batch(tok, rows: int, comp_tokens: int) -> list[Sequence]:
    from flows.config import RunConfig
    from tasks.ingest import load_source

    spec = RunConfig().pool.sources[0]
    qs = [r.text for r in load_source(spec.source, rows, 0, dict(spec.params))[0]]
    g = torch.Generator().manual_seed(0)
    out = []
    for i, q in enumerate(qs[:rows]):
        p = tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
                add_special_tokens=False)["input_ids"]
        c = torch.randint(100, 20000, (comp_tokens,), generator=g).tolist()
        out.append(Sequence(p, c, 1.0 if i % 2 else -1.0))
    return out


def fewshot_batch(tok, rows: int, group_size: int, prompt_tokens: int, comp_tokens: int) -> list[Sequence]:
    """rows // group_size groups of group_size rows: each group one few-shot prompt (solved demonstrations of
    other pool questions as earlier turns, as many as fit in prompt_tokens, at least one) and random completions."""
    from flows.config import RunConfig
    from tasks.core.fewshot import ask
    from tasks.ingest import load_source

    cfg = RunConfig()
    spec = cfg.pool.sources[0]
    pool = load_source(spec.source, 64, 0, dict(spec.params))[0]
    g = torch.Generator().manual_seed(1)
    out = []
    for k in range(rows // group_size):
        q = pool[k % len(pool)]
        msgs: list[dict] = []
        ids: list[int] = []
        for d in (pool[(k + 1 + j) % len(pool)] for j in range(len(pool) - 1)):
            demo = [ask(d.text, cfg.rollout.instruction),
                    {"role": "assistant", "content": f"Let me work it out step by step. {d.text.splitlines()[0]} "
                                                     f"The result is {d.answer}, so the answer is \\boxed{{{d.answer}}}."}]
            text = tok.apply_chat_template([*msgs, *demo, ask(q.text, cfg.rollout.instruction)], tokenize=False,
                                           add_generation_prompt=True)
            longer = tok(text, add_special_tokens=False)["input_ids"]
            if ids and len(longer) > prompt_tokens:
                break
            msgs, ids = msgs + demo, longer
        for i in range(group_size):
            c = torch.randint(100, 20000, (comp_tokens,), generator=g).tolist()
            out.append(Sequence(list(ids), c, 1.0 if i % 2 else -1.0))
    return out


def spread(v: list[float]) -> str:
    return f"median {statistics.median(v):.2f} s (min {min(v):.2f}, max {max(v):.2f})"


def bare_step(model, seqs, micro, pad_id, lr) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    tokens = sum(len(s.completion_ids) for s in seqs)
    for k in range(0, len(seqs), micro):
        part = seqs[k : k + micro]
        width = max(len(s.prompt_ids) + len(s.completion_ids) for s in part)
        ids = torch.full((len(part), width), pad_id)
        labels = torch.full((len(part), width), -100)
        attn = torch.zeros((len(part), width), dtype=torch.long)
        for r, s in enumerate(part):
            seq = s.prompt_ids + s.completion_ids
            ids[r, : len(seq)] = torch.tensor(seq)
            attn[r, : len(seq)] = 1
            labels[r, len(s.prompt_ids) : len(seq)] = torch.tensor(s.completion_ids)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), reduction="sum")
        (loss / tokens).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--completion-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefix-rows", type=int, default=16, help="rows of the shared-prefix comparison (0: skip it)")
    ap.add_argument("--group-size", type=int, default=8, help="G of the shared-prefix comparison")
    ap.add_argument("--prompt-tokens", type=int, default=250, help="few-shot prompt length to reach, in tokens")
    ap.add_argument("--prefix-completion-tokens", type=int, default=40)
    ap.add_argument("--json", help="write the figures here as flat keys")
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve(a.model)
    tok = AutoTokenizer.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref = copy.deepcopy(base).requires_grad_(False)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    seqs = batch(tok, a.rows, a.completion_tokens)
    tokens = sum(len(s.completion_ids) for s in seqs)
    cfg = TrainConfig(lr=1e-6, weight_decay=0.0, eps_low=0.2, eps_high=0.28, kl_coef=0.01, sft_weight=0.0,
                      rows_per_step=a.rows, micro_batch=a.micro, max_grad_norm=1.0,
                      micro_tokens=10_000_000)
    print(f"torch threads {torch.get_num_threads()}; {a.rows} sequences x {a.completion_tokens} completion tokens "
          f"({tokens} trained tokens), micro-batch {a.micro}")
    times = {"bare": [], "ours_step": [], "ours_round": []}
    for rep in range(a.repeats):
        m = copy.deepcopy(base).train()
        times["bare"].append(bare_step(m, seqs, a.micro, pad, cfg.lr))
        del m
        m = copy.deepcopy(base)
        t0 = time.perf_counter()
        rows = train_round(m, ref, seqs, [], cfg, TrainPlan(0.7, pad, seed=rep,  # rollout.temperature's default
                                                            first_step_on_policy=False))  # one step: keep its old pass
        times["ours_round"].append(time.perf_counter() - t0)
        times["ours_step"].append(rows[0]["seconds"])
        del m
        print(f"repeat {rep}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()))
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"{k:>10}: median {v:.2f} s, {tokens / v:.0f} trained tokens/s")
    print(f"overhead ratio ours_step / bare = {med['ours_step'] / med['bare']:.3f} (target <= 1.15)")
    print(f"whole round (old + reference log-probs recomputed) / bare = {med['ours_round'] / med['bare']:.3f}")
    figures = {"train_ratio_vs_bare": med["ours_step"] / med["bare"],
               "train_round_ratio_vs_bare": med["ours_round"] / med["bare"], "train_tokens": tokens,
               **{f"{k}_s": v for k, v in med.items()}, **{f"{k}_tok_s": tokens / v for k, v in med.items()}}
    if a.prefix_rows:
        figures |= prefix_comparison(a, tok, base, ref, pad)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(figures, f, indent=1)
        print(f"wrote {a.json}")


def prefix_comparison(a, tok, base, ref, pad) -> dict:
    """The whole train_round on the few-shot batch, shared_prefix true vs false, at the default micro-batch
    limits, from the same weights each repeat; returns the flat figures."""
    seqs = fewshot_batch(tok, a.prefix_rows, a.group_size, a.prompt_tokens, a.prefix_completion_tokens)
    p_len = statistics.mean(len(s.prompt_ids) for s in seqs)
    tokens = sum(len(s.completion_ids) for s in seqs)
    cfg = TrainConfig(lr=1e-6, sft_weight=0.0, rows_per_step=len(seqs))
    print(f"shared prefix: {len(seqs) // a.group_size} groups x G = {a.group_size}, prompts {p_len:.0f} tokens, "
          f"completions {a.prefix_completion_tokens} tokens; micro_batch {cfg.micro_batch}, "
          f"micro_tokens {cfg.micro_tokens}")
    times: dict[str, list[float]] = {"shared": [], "unshared": [], "shared_step": [], "unshared_step": []}
    for rep in range(a.repeats):
        for name, shared in (("unshared", False), ("shared", True)):
            m = copy.deepcopy(base)
            t0 = time.perf_counter()
            rows = train_round(m, ref, seqs, [], cfg.model_copy(update={"shared_prefix": shared}),
                               TrainPlan(0.7, pad, seed=rep, first_step_on_policy=False))
            times[name].append(time.perf_counter() - t0)
            times[f"{name}_step"].append(rows[0]["seconds"])
            del m
        print(f"repeat {rep}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()))
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        print(f"{k:>14}: {spread(v)}, {tokens / med[k]:.0f} trained tokens/s")
    # each repeat runs both back to back, so the per-repeat ratio is robust to load that drifts between repeats
    ratios = [u / s for u, s in zip(times["unshared"], times["shared"])]
    step_ratios = [u / s for u, s in zip(times["unshared_step"], times["shared_step"])]
    speedup, step_speedup = statistics.median(ratios), statistics.median(step_ratios)
    print(f"train_prefix_speedup (whole train_round, unshared / shared, median of the repeats' ratios) = "
          f"{speedup:.2f} (min {min(ratios):.2f}, max {max(ratios):.2f}; target >= 2.5); optimizer step alone "
          f"{step_speedup:.2f} (min {min(step_ratios):.2f}, max {max(step_ratios):.2f})")
    return {"train_prefix_speedup": speedup, "train_prefix_speedup_min": min(ratios),
            "train_prefix_speedup_max": max(ratios), "train_prefix_speedup_step": step_speedup,
            "train_prefix_prompt_tokens": p_len, "train_prefix_group_size": a.group_size,
            "train_prefix_rows": len(seqs), **{f"prefix_{k}_s": v for k, v in med.items()},
            **{f"prefix_{k}_min_s": min(v) for k, v in times.items()},
            **{f"prefix_{k}_max_s": max(v) for k, v in times.items()}}


if __name__ == "__main__":
    main()
