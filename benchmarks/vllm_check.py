"""vLLM checks for benchmarks/gpu_check.py (`--vllm`): the vllm backend against the trainer and raw vLLM.

Each part runs in its own process (`--part`), since a process holds one vLLM engine on the GPU. Without CUDA
(vLLM's CPU build, `make test-vllm`'s .venv-vllm) the parts run on the CPU, with two limits: --tiny must name a
model with a head size vLLM's CPU kernels take (32 or more; the registry's tiny-random has 16, so `flow` needs
`--tiny`'s model, not tiny-random), and there is no sleep mode, so no memory freed by sleep is reported.
tests/test_vllm_cpu.py runs the correctness checks and the flow on CPU as tests.
`correctness` (the tiny random model, fp32 in vLLM and in the trainer):
- log-probs: each sampled token's log-prob as vLLM reports it (T = 0.7, processed log-probs) against the
  trainer's log_softmax(logits / T) over the same ids, and `score_ids` (prompt log-probs over the exact ids)
  against the transformers backend's at T = 1: max and median |difference|;
- keyed sampling: the share of prompts whose samples are the same batched as alone;
- GRPO through vLLM rollouts: the share of a fixed first token rises over two updates, each update saved as
  a checkpoint and reloaded into the same engine in place (one engine built, two reloads);
- reload: after the reload, vLLM's scores match the transformers backend on the new checkpoint (and not on
  the old one); after a level-2 sleep and a wake they still do.
`mcmc` (the embedded SmolLM2-135M-Instruct, which ends its proposals; the tiny model's are all cut by the
length limit, so every chain would reject every move and agree trivially): MCMC (tasks/core/mcmc.py) on vLLM,
batched and one chain at a time, with how many proposals were scored (not cut) and accepted, and how many
decisions agree.
`flow`: `curriculum` 2 rounds on the tiny model with model.backend = vllm and shaping on, in this process:
the stages that ran, the row counts, and the engine built once.
`speed` (a SmolLM2-135M-shaped model with random weights, bf16): our `generate` (our tokenisation, one
SamplingParams per prompt with its row seed, decoding) against `LLM.generate` on the same engine with the same
prompt texts and one SamplingParams(n=G): useful tokens/s and their ratio (target >= 0.95).

    python benchmarks/vllm_check.py --part correctness|mcmc|flow|speed --tiny DIR [--config-dir DIR] --out FILE
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from models.backend import Sampling  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # vllm-cpu: the module docstring


def diffs(xs: list[list[float]], ys: list[list[float]]) -> dict:
    d = [abs(a - b) for x, y in zip(xs, ys) for a, b in zip(x, y)]
    return {"max": max(d), "median": statistics.median(d), "n": len(d)}


@functools.cache
def load_gpu_check():
    """benchmarks/gpu_check.py as a module (benchmarks/ is not a package, and is kept off sys.path: its
    select.py would shadow the standard library's)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(os.path.dirname(__file__), "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

def correctness(tiny: str) -> dict:
    from transformers import AutoModelForCausalLM

    from models.hf.backend import TransformersBackend
    from models.vllm_backend import VLLMBackend
    from tasks.core.grpo import TrainPlan, train_round

    out = {}
    v = VLLMBackend(tiny, dtype="fp32")
    hf = TransformersBackend(tiny, device=DEV, dtype="fp32", batch_size=64)
    ids = v.encode(load_gpu_check().prompts_for(v, 8))
    warm = v.generate_ids(ids, 4, Sampling(0.7, 1.0, 16, 0), row_seeds=list(range(8)))
    flat = [(ids[i], c) for i, g in enumerate(warm) for c in g if c.token_ids]
    trainer = hf.score_ids([p for p, _ in flat], [c.token_ids for _, c in flat], temperature=0.7)
    out["sampled_logprob_vs_trainer_t07"] = diffs([c.logprobs for _, c in flat], trainer)
    comps = [c.token_ids for _, c in flat]
    out["score_ids_vs_transformers_t1"] = diffs(v.score_ids([p for p, _ in flat], comps),
                                                hf.score_ids([p for p, _ in flat], comps))
    alone = [v.generate_ids([ids[i]], 4, Sampling(0.7, 1.0, 16, 0), row_seeds=[i])[0] for i in range(8)]
    out["keyed_sampling_batch_invariant_share"] = sum(
        [c.token_ids for c in x] == [c.token_ids for c in y] for x, y in zip(warm, alone)) / 8

    gpu_check = load_gpu_check()
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).to(DEV)
    ref = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).to(DEV).eval()
    current, tmp = {"policy": v}, tempfile.mkdtemp(prefix="vllm-check-")

    def update(seqs, it):
        current["policy"].engine.sleep()  # the trainer has the GPU while the engine sleeps
        train_round(model, ref, seqs, [], gpu_check.FIXED_TOKEN_TRAIN, TrainPlan(0.3, hf.pad_id, DEV, "fp32", seed=it))
        path = os.path.join(tmp, f"v{it + 1}")
        model.save_pretrained(path, safe_serialization=True)
        v.tokenizer.save_pretrained(path)
        current["policy"] = VLLMBackend(path, dtype="fp32")  # the same engine, this checkpoint's weights

    shares = gpu_check.fixed_token_shares(lambda *a: current["policy"].generate_ids(*a), update,
                                          gpu_check.token_prompts(v))
    policy = current["policy"]
    out["grpo_fixed_token_share_over_updates"] = shares
    from models import vllm_backend

    out["engines_built"], out["engine_reloads"] = vllm_backend.ENGINES_BUILT, policy.engine.reloads

    new_hf = TransformersBackend(policy.path, device=DEV, dtype="fp32", batch_size=64)
    probe_p, probe_c = [p for p, _ in flat[:16]], comps[:16]
    mine = policy.score_ids(probe_p, probe_c)
    out["reloaded_scores_vs_new_checkpoint"] = diffs(mine, new_hf.score_ids(probe_p, probe_c))
    out["reloaded_scores_vs_old_checkpoint"] = diffs(mine, hf.score_ids(probe_p, probe_c))
    if DEV == "cuda":
        free_awake = torch.cuda.mem_get_info()[0]
        policy.engine.sleep()
        out["gpu_gib_freed_by_sleep"] = (torch.cuda.mem_get_info()[0] - free_awake) / 2**30
    out["after_sleep_and_wake_vs_new_checkpoint"] = diffs(policy.score_ids(probe_p, probe_c),
                                                          new_hf.score_ids(probe_p, probe_c))

    return out


def mcmc() -> dict:
    from models.registry import resolve
    from models.vllm_backend import VLLMBackend
    from tasks.core.mcmc import shape_traces

    v = VLLMBackend(resolve("default"), dtype="bf16")
    runs = {}
    for batched in (True, False):
        traces = load_gpu_check().make_traces(v, 8, 64)  # the whole start trace, ending in EOS
        shape_traces(v, traces, 6, "mh", 48, batched=batched)
        runs[batched] = traces
    a, b = runs[True], runs[False]
    return {"decisions": sum(len(t.decisions) for t in a),
            "decisions_agree": sum(x == y for s, t in zip(a, b) for x, y in zip(s.decisions, t.decisions)),
            "proposals_cut": sum(t.rejected_cut for t in a), "accepted": sum(t.accepted for t in a),
            "proposals_scored": sum(t.proposed - t.rejected_cut - t.rejected_irreversible for t in a)}


def flow(tiny: str) -> dict:
    os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="vllm-prefect-"))  # an ephemeral Prefect API
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from flows.config import load_config
    from flows.curriculum import curriculum
    from models import vllm_backend
    from storage.query import sql
    from storage.store import Store

    root = tempfile.mkdtemp(prefix="vllm-flow-")
    sets = [f"model.policy={tiny}", "model.backend=vllm", f"model.device={DEV}", "model.dtype=fp32",
            "rollout.max_new_tokens=8", "rollout.group_size=4", "select.embedder=hashing", "select.batch_size=6",
            # as tests/test_curriculum.py's TINY: with the defaults of these two this flow collected no rollout on vllm-cpu
            "rollout.screen_samples=0", "rollout.include_reserve=true",
            "shape.enabled=true", 'pool.sources=[{"source": "rg:products", "size": 8, "params": {"max_digits": 1}}]']
    t0 = time.time()
    out = curriculum(load_config(sets=sets, run_id="vllm", store=root, rounds=2))
    store = Store(root)
    counts = sql(store, """SELECT (SELECT count(*) FROM rollouts WHERE run_id = 'vllm') AS rollouts,
                                  (SELECT count(*) FROM shaped_traces WHERE run_id = 'vllm') AS shaped,
                                  (SELECT count(*) FROM checkpoints WHERE run_id = 'vllm') AS checkpoints,
                                  (SELECT count(*) FROM evals WHERE run_id = 'vllm') AS evals""").to_pylist()[0]
    engine = vllm_backend._ENGINE
    return {"stages": [s["stage"] for s in out["stages"]], **counts, "seconds": time.time() - t0,
            "engines_built": vllm_backend.ENGINES_BUILT, "engine_reloads": engine.reloads if engine else 0}


def speed(config_dir: str, tiny: str) -> dict:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from models.vllm_backend import VLLMBackend

    path = tempfile.mkdtemp(prefix="vllm-speed-")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig.from_pretrained(config_dir)).to(torch.bfloat16).save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(path)
    b = VLLMBackend(path, dtype="bf16")
    prompts, n, new = load_gpu_check().prompts_for(b, 64), 8, 128
    s = Sampling(0.7, 1.0, new, 0)
    vllm, llm = b.engine.vllm, b.engine.llm
    b.generate(prompts[:4], 2, Sampling(0.7, 1.0, 8, 0))  # warm-up
    ours, raw = [], []
    for rep in range(3):
        t0 = time.perf_counter()
        tokens = sum(c.n_tokens + (c.finish_reason == "stop") for g in b.generate(prompts, n, s) for c in g)
        ours.append(tokens / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        outs = llm.generate(prompts, vllm.SamplingParams(n=n, temperature=0.7, max_tokens=new, seed=rep, logprobs=0),
                            use_tqdm=False)
        raw.append(sum(len(c.token_ids) for o in outs for c in o.outputs) / (time.perf_counter() - t0))
    return {"ours_tokens_per_s": statistics.median(ours), "raw_vllm_tokens_per_s": statistics.median(raw),
            "ratio_vs_raw_vllm": statistics.median(ours) / statistics.median(raw),
            "ratio_spread": [min(ours) / max(raw), max(ours) / min(raw)]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=("correctness", "mcmc", "flow", "speed"), required=True)
    ap.add_argument("--tiny", required=True, help="the tiny-random model folder")
    ap.add_argument("--config-dir", help="a folder with the SmolLM2-135M config.json (speed)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    t0 = time.time()
    parts = {"correctness": lambda: correctness(a.tiny), "mcmc": mcmc, "flow": lambda: flow(a.tiny),
             "speed": lambda: speed(a.config_dir, a.tiny)}
    result = parts[a.part]()
    result["part_seconds"] = time.time() - t0
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1), flush=True)


if __name__ == "__main__":
    main()
