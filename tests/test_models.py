import importlib.util

import pytest

from models.registry import ModelSpecError, load_backend, resolve


def test_specs_resolve_or_name_the_problem(tmp_path):
    assert resolve("tiny-random").endswith("tiny-random-llama-v2-0")
    with pytest.raises(ModelSpecError, match="no config.json"):
        resolve(str(tmp_path))
    with pytest.raises(ModelSpecError, match="no such folder"):
        resolve("./does/not/exist")
    assert resolve("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    with pytest.raises(ModelSpecError, match="unknown backend"):
        load_backend("tiny-random", backend="tgi")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_vllm_backend_without_vllm_says_what_to_do():
    with pytest.raises(ImportError, match=r"needs vLLM.*\[gpu\].*make test-vllm"):
        load_backend("tiny-random", backend="vllm")


def _has_cuda():
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda() or importlib.util.find_spec("vllm") is None, reason="needs a GPU and vLLM")
def test_vllm_matches_transformers_greedy():
    from models.backend import Sampling

    v = load_backend("default", backend="vllm")
    t = load_backend("default", backend="transformers", device="cuda", dtype="fp32")
    p = [t.render([{"role": "user", "content": "What is 7 * 8?"}])]
    s = Sampling(temperature=0.0, max_new_tokens=16)
    assert v.generate(p, 1, s)[0][0].text == t.generate(p, 1, s)[0][0].text


_GGUF_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "ffn_down": "mlp.down_proj",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "attn_q": "self_attn.q_proj",
               "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj"}


def _unpermute(w, heads: int):
    """llama.cpp stores q/k rows interleaved for its RoPE layout; transformers' order (its GGUF loader's
    reverse_permute)."""
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def test_default_model_conversion_is_cached_and_equal():
    """The embedded GGUF converts once; every tensor of the cached safetensors equals the GGUF's own,
    dequantised (read with the gguf library, not with the loader that made the copy)."""
    import json
    from pathlib import Path

    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.numpy import load_file

    from models.registry import gguf_path

    path = Path(resolve("default"))
    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    before = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    assert resolve("default") == str(path)  # cached: same folder, and nothing in it rewritten
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == before
    config = json.loads((path / "config.json").read_text())
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    cached = load_file(path / "model.safetensors")
    compared = set()
    for t in GGUFReader(str(gguf_path())).tensors:
        parts = t.name.split(".")  # blk.<i>.<kind>.weight | token_embd.weight | output_norm.weight
        if parts[0] == "blk":
            name = f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.weight"
        else:
            name = {"token_embd": "model.embed_tokens.weight", "output_norm": "model.norm.weight"}[parts[0]]
        w = dequantize(t.data, t.tensor_type).reshape(cached[name].shape)
        if parts[0] == "blk" and parts[2] in heads:
            w = _unpermute(w, heads[parts[2]])
        assert np.allclose(w, cached[name], atol=1e-6), name
        compared.add(name)
    assert compared == set(cached) - {"lm_head.weight"}  # tied to the embeddings
