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
Medians over --repeats; every variant starts from the same weights each repeat.

    python benchmarks/train.py [--rows 32] [--micro 8] [--completion-tokens 48] [--repeats 3]
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run as a script, this folder's select.py would shadow the standard library's `select`
import argparse  # noqa: E402
import copy  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from models.registry import resolve  # noqa: E402
from tasks.core.grpo import Sequence, TrainConfig, train_round  # noqa: E402


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
        rows = train_round(m, ref, seqs, [], cfg, pad, seed=rep, temperature=0.7)  # rollout.temperature's default
        times["ours_round"].append(time.perf_counter() - t0)
        times["ours_step"].append(rows[0]["seconds"])
        del m
        print(f"repeat {rep}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()))
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"{k:>10}: median {v:.2f} s, {tokens / v:.0f} trained tokens/s")
    print(f"overhead ratio ours_step / bare = {med['ours_step'] / med['bare']:.3f} (target <= 1.15)")
    print(f"whole round (old + reference log-probs recomputed) / bare = {med['ours_round'] / med['bare']:.3f}")


if __name__ == "__main__":
    main()
