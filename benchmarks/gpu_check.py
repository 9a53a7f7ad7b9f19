"""GPU checks of the torch paths, and their speed, on a CUDA machine (needs only torch and transformers).

Correctness, on the tiny random model (fp32 on the GPU):
- keyed sampling: a prompt's samples are the same batched or alone;
- `score_ids` agrees with the log-probs `generate_ids` reported, at T = 1 and at the sampling temperature 0.7;
- GRPO learns a fixed token (its share of first tokens rises) and unlearns it with the reward flipped;
- MCMC: batched and one-at-a-time chains make the same decisions.
Speed, on a SmolLM2-135M-shaped model with random weights (speed does not depend on the values; the real
weights are too large to carry to the machine), bf16 autocast:
- rollout tokens/s of `TransformersBackend.generate` against `model.generate` over fixed batches;
- one GRPO optimizer step against a bare forward/backward/AdamW loop on the same batch;
- batched MCMC against one trace at a time.
With `--vllm` (the `gpu` extra installed): benchmarks/vllm_check.py's correctness, whole-flow and speed checks
of the vllm backend, each in its own process, under "vllm" in the summary.
Writes a JSON summary (nested by part) to --out, and with --json PATH the same figures as flat keys (the
nested names joined by "_", e.g. speed_rollout_ratio; lists and failures' text tails left out).

    python benchmarks/gpu_check.py --tiny DIR --config-dir DIR [--vllm] [--out gpu.json] [--json PATH]
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import argparse  # noqa: E402
import collections  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from models.backend import Sampling  # noqa: E402
from models.hf.backend import TransformersBackend  # noqa: E402
from tasks.core.advantages import group_advantages
from tasks.core.grpo import Sequence, TrainConfig, TrainPlan, train_round  # noqa: E402
from tasks.core.mcmc import Trace, shape_traces  # noqa: E402

DEV = "cuda"


def sync() -> None:
    if DEV.startswith("cuda"):
        torch.cuda.synchronize()


def prompts_for(b, n: int) -> list[str]:
    return [b.render([{"role": "user", "content": f"Question {i}: what is {i} times {i + 3}? Think step by step."}])
            for i in range(n)]


def token_prompts(b, n: int = 16) -> list[list[int]]:
    """The GRPO check's prompts (`fixed_token_shares`), as ids."""
    return b.encode([b.render([{"role": "user", "content": f"Question {i}: name a token."}]) for i in range(n)])


def check_correctness(tiny: str) -> dict:
    out = {}
    b = TransformersBackend(tiny, device=DEV, dtype="fp32", batch_size=64)
    ids = b.encode(prompts_for(b, 6))
    s = Sampling(1.0, 1.0, 12, 0)
    both = b.generate_ids(ids, 2, s, row_seeds=list(range(6)))
    alone = [b.generate_ids([ids[i]], 2, s, row_seeds=[i])[0] for i in range(6)]
    out["keyed_sampling_batch_invariant"] = all(
        [c.token_ids for c in x] == [c.token_ids for c in y] for x, y in zip(both, alone))
    flat = [(ids[i], c) for i, g in enumerate(both) for c in g if c.token_ids]
    scored = b.score_ids([p for p, _ in flat], [c.token_ids for _, c in flat])
    out["score_vs_generate_max_abs_diff"] = max(abs(a - x) for (_, c), sc in zip(flat, scored)
                                                for a, x in zip(c.logprobs, sc))
    warm = b.generate_ids(ids, 2, Sampling(0.7, 1.0, 12, 0))  # log-probs at T = 0.7 (models/backend.py)
    flat = [(ids[i], c) for i, g in enumerate(warm) for c in g if c.token_ids]
    scored = b.score_ids([p for p, _ in flat], [c.token_ids for _, c in flat], temperature=0.7)
    out["score_vs_generate_max_abs_diff_t07"] = max(abs(a - x) for (_, c), sc in zip(flat, scored)
                                                    for a, x in zip(c.logprobs, sc))

    from transformers import AutoModelForCausalLM

    for sign in (True, False):
        b = TransformersBackend(tiny, device=DEV, dtype="fp32", batch_size=128)
        ref = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).to(DEV).eval()

        def update(seqs, it, b=b, ref=ref):
            train_round(b.model, ref, seqs, [], FIXED_TOKEN_TRAIN, TrainPlan(0.3, b.pad_id, DEV, "fp32", seed=it))

        shares = fixed_token_shares(b.generate_ids, update, token_prompts(b), rewarded=sign)
        out["grpo_fixed_token_share_" + ("rewarded" if sign else "penalised")] = shares

    b = TransformersBackend(tiny, device=DEV, dtype="fp32", batch_size=64)
    decisions = []
    for batched in (True, False):
        traces = make_traces(b, 6, 5)
        shape_traces(b, traces, 4, "mh", 4, batched=batched)
        decisions.append([t.decisions for t in traces])
    out["mcmc_batched_equals_sequential"] = decisions[0] == decisions[1]
    out["mcmc_accepted"] = sum(map(sum, decisions[0]))
    return out


FIXED_TOKEN_TRAIN = TrainConfig(lr=1e-3, weight_decay=0.0, eps_low=0.2, eps_high=0.28, kl_coef=0.01, sft_weight=0.0,
                                rows_per_step=64, micro_batch=32, max_grad_norm=1.0, micro_tokens=10_000_000)


def fixed_token_shares(generate_ids, update, prompt_ids: list[list[int]], rewarded: bool = True) -> list[float]:
    """GRPO's learning check (for each backend): the share of first tokens equal to the most common one, over
    three draws of 8 samples per prompt, with `update(sequences, it)` after each of the first two. The reward is
    1 for that token (0 when `rewarded` is false, so the share should fall instead)."""
    first = generate_ids(prompt_ids, 8, Sampling(0.3, 1.0, 1, 99))
    target = collections.Counter(c.token_ids[0] for g in first for c in g if c.token_ids).most_common(1)[0][0]
    shares = []
    for it in range(3):
        gen = generate_ids(prompt_ids, 8, Sampling(0.3, 1.0, 1, 100 + it))
        hits = [[bool(c.token_ids) and c.token_ids[0] == target for c in g] for g in gen]
        shares.append(sum(map(sum, hits)) / sum(map(len, hits)))
        if it == 2:
            return shares
        seqs = []
        for p, g, h in zip(prompt_ids, gen, hits):
            adv = group_advantages([float(x == rewarded) for x in h])
            if adv is not None:
                seqs += [Sequence(p, c.token_ids, a) for c, a in zip(g, adv) if c.token_ids]
        update(seqs, it)
    return shares

def make_traces(b, n: int, length: int) -> list[Trace]:
    x = b.encode(prompts_for(b, n))
    ctx = b.encode([p + "Reference: 7 * 8 = 56." for p in prompts_for(b, n)])
    # a start trace is a complete one, ending in EOS: a chain never moves from a cut trace (irreversible)
    start = b.encode(["so 7 * 8 = 56 and the answer is 56."])[0][:length] + [b.eos_ids[0]]
    return [Trace(f"gpu{k}", x[k], ctx[k], list(start), lambda ids: True) for k in range(n)]


def timed(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def check_speed(config_dir: str, tiny: str) -> dict:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = {}
    config = LlamaConfig.from_pretrained(config_dir)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(DEV).eval()
    tok = AutoTokenizer.from_pretrained(tiny)
    b = TransformersBackend(tiny, device=DEV, dtype="auto", batch_size=128, model=model, tokenizer=tok)
    prompts = prompts_for(b, 16)
    n, new = 8, 64
    s = Sampling(0.7, 1.0, new, 0)
    useful = [0]

    def ours():
        useful[0] = sum(c.n_tokens for g in b.generate(prompts, n, s) for c in g)

    b.generate(prompts[:2], 2, Sampling(0.7, 1.0, 4, 0))  # warm-up
    t = timed(ours, 3)
    out["rollout_ours_tokens_per_s"] = useful[0] / t
    tok.padding_side = "left"
    rows = [p for p in prompts for _ in range(n)]

    def naive():
        total = 0
        for k in range(0, len(rows), 64):
            enc = tok(rows[k : k + 64], return_tensors="pt", padding=True, add_special_tokens=False).to(DEV)
            with torch.autocast(DEV.split(":")[0], dtype=torch.bfloat16):
                g = model.generate(**enc, do_sample=True, temperature=0.7, max_new_tokens=new,
                                   pad_token_id=tok.pad_token_id or tok.eos_token_id)
            total += (g.shape[1] - enc["input_ids"].shape[1]) * g.shape[0]
        useful[0] = total

    t = timed(naive, 3)
    out["rollout_naive_generate_tokens_per_s"] = useful[0] / t
    out["rollout_ratio_ours_vs_naive"] = out["rollout_ours_tokens_per_s"] / out["rollout_naive_generate_tokens_per_s"]

    # training: one GRPO step vs a bare loop, same batch
    import torch.nn.functional as F

    seqs = []
    g = torch.Generator().manual_seed(0)
    for i, p in enumerate(b.encode(prompts * 4)):
        seqs.append(Sequence(p, torch.randint(100, 20000, (96,), generator=g).tolist(), 1.0 if i % 2 else -1.0))
    tokens = sum(len(x.completion_ids) for x in seqs)
    cfg = TrainConfig(lr=1e-6, weight_decay=0.0, eps_low=0.2, eps_high=0.28, kl_coef=0.01, sft_weight=0.0,
                      rows_per_step=len(seqs), micro_batch=32, max_grad_norm=1.0,
                      micro_tokens=10_000_000)
    base = model
    ref = copy.deepcopy(base).requires_grad_(False)

    def bare():
        m = bare.m
        opt = torch.optim.AdamW(m.parameters(), lr=1e-6)
        opt.zero_grad(set_to_none=True)
        for k in range(0, len(seqs), 32):
            part = seqs[k : k + 32]
            width = max(len(x.prompt_ids) + len(x.completion_ids) for x in part)
            ids = torch.full((len(part), width), b.pad_id)
            labels = torch.full((len(part), width), -100)
            attn = torch.zeros((len(part), width), dtype=torch.long)
            for r, x in enumerate(part):
                q = x.prompt_ids + x.completion_ids
                ids[r, : len(q)] = torch.tensor(q)
                attn[r, : len(q)] = 1
                labels[r, len(x.prompt_ids) : len(q)] = torch.tensor(x.completion_ids)
            with torch.autocast(DEV.split(":")[0], dtype=torch.bfloat16):
                logits = m(input_ids=ids.to(DEV), attention_mask=attn.to(DEV)).logits[:, :-1].float()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1).to(DEV),
                                   reduction="sum")
            (loss / tokens).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()

    step_times, round_times, bare_times = [], [], []
    for rep in range(3):
        bare.m = copy.deepcopy(base).train()
        bare_times.append(timed(bare, 1))
        m = copy.deepcopy(base)
        sync()
        t0 = time.perf_counter()
        rows = train_round(m, ref, seqs, [], cfg, TrainPlan(0.7, b.pad_id, DEV, "bf16", seed=rep))
        sync()
        round_times.append(time.perf_counter() - t0)
        step_times.append(rows[0]["seconds"])
        del m, bare.m
        if DEV.startswith("cuda"):
            torch.cuda.empty_cache()
    out["train_tokens"] = tokens
    out["train_bare_tokens_per_s"] = tokens / statistics.median(bare_times)
    out["train_ours_step_tokens_per_s"] = tokens / statistics.median(step_times)
    out["train_overhead_ratio_step_vs_bare"] = statistics.median(step_times) / statistics.median(bare_times)
    out["train_round_vs_bare"] = statistics.median(round_times) / statistics.median(bare_times)

    # shaping: batched vs one at a time
    times = {}
    decisions = {}
    for batched in (True, False):
        def run(batched=batched):
            traces = make_traces(b, 32, 24)
            shape_traces(b, traces, 3, "mh", 48, batched=batched)
            decisions[batched] = [t.decisions for t in traces]

        times[batched] = timed(run, 1)
    out["shape_batched_s"], out["shape_sequential_s"] = times[True], times[False]
    out["shape_speedup"] = times[False] / times[True]
    out["shape_decisions_agree"] = sum(x == y for a, c in zip(decisions[True], decisions[False]) for x, y in zip(a, c))
    out["shape_decisions"] = sum(len(a) for a in decisions[True])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", required=True, help="the tiny-random model folder")
    ap.add_argument("--config-dir", required=True, help="a folder with the SmolLM2-135M config.json")
    ap.add_argument("--out", default="gpu.json")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the figures as flat keys")
    ap.add_argument("--device", default="cuda", help="cpu runs the same checks slowly (to test this script)")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--vllm", action="store_true", help="also run benchmarks/vllm_check.py's parts")
    a = ap.parse_args()
    global DEV
    DEV = a.device
    import transformers

    summary = {"device": torch.cuda.get_device_name(0) if DEV.startswith("cuda") else DEV, "torch": torch.__version__,
               "transformers": transformers.__version__}
    t0 = time.time()
    summary["correctness"] = check_correctness(a.tiny)
    summary["correctness_seconds"] = time.time() - t0
    print(json.dumps(summary, indent=1), flush=True)
    if not a.skip_speed:
        t0 = time.time()
        summary["speed"] = check_speed(a.config_dir, a.tiny)
        summary["speed_seconds"] = time.time() - t0
        print(json.dumps(summary, indent=1), flush=True)
    if a.vllm:
        summary["vllm"] = vllm_parts(a.tiny, a.config_dir, skip_speed=a.skip_speed)
        print(json.dumps(summary, indent=1), flush=True)
    with open(a.out, "w") as f:
        json.dump(summary, f, indent=1)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(flat(summary), f, indent=1, sort_keys=True)


def flat(tree: dict, prefix: str = "") -> dict:
    """Nested figures as one level of keys joined by "_"; only numbers, booleans, None and short strings.

    >>> flat({"speed": {"ratio": 1.5, "ok": True}, "device": "cpu", "tail": "x" * 500, "seeds": [1, 2]})
    {'speed_ratio': 1.5, 'speed_ok': True, 'device': 'cpu'}
    """
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= flat(value, f"{name}_")
        elif value is None or isinstance(value, (bool, int, float)) or (isinstance(value, str) and len(value) <= 200):
            out[name] = value
    return out


def vllm_parts(tiny: str, config_dir: str, skip_speed: bool) -> dict:
    """benchmarks/vllm_check.py's parts, one process each (a process holds one engine); a part that fails
    is reported with its last lines instead of its figures."""
    import subprocess
    import tempfile

    out = {}
    for part in ("correctness", "mcmc", "flow") + (() if skip_speed else ("speed",)):
        dest = os.path.join(tempfile.mkdtemp(), f"{part}.json")
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_check.py")
        proc = subprocess.run([sys.executable, script, "--part", part, "--tiny", tiny, "--config-dir", config_dir,
                               "--out", dest], capture_output=True, text=True)
        if proc.returncode == 0:
            with open(dest) as f:
                out[part] = json.load(f)
        else:
            out[part] = {"failed": proc.returncode, "tail": (proc.stdout + proc.stderr)[-3000:]}
    return out


if __name__ == "__main__":
    main()
