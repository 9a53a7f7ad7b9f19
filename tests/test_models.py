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
    with pytest.raises(ImportError, match="CUDA-only.*gpu"):
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


def test_default_model_conversion_is_cached_and_equal():
    """The embedded GGUF converts once; the cached folder holds safetensors and loads."""
    from pathlib import Path

    path = Path(resolve("default"))
    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    assert resolve("default") == str(path)  # cached: same folder, no second conversion
