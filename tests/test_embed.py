"""The `policy` embedder: its batch reaches the model on the model's device, and its vectors are right.

A CPU-only machine has one real device, so the device test puts a copy of the tiny model on `meta` (where
a forward runs the real module code on shapes alone) and records, with a forward pre-hook, the device of
every tensor the decoder is given. Before the fix the tokenizer's CPU tensors went in unmoved; a meta model
accepts them silently (which is why a meta model alone proves nothing), but the hook sees cpu != meta. On
CUDA the same batch failed with "Expected all tensors to be on the same device".
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tasks.selectors.embed import embed, embed_policy, policy_vectors

TEXTS = ["What is 7 times 8?", "Compute the sum of 12, 5 and 30, then subtract four from the total."]


def _record_inputs(decoder) -> tuple[list[torch.device], object]:
    seen: list[torch.device] = []

    def hook(module, args, kwargs):
        seen.extend(t.device for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))

    return seen, decoder.register_forward_pre_hook(hook, with_kwargs=True)


def test_policy_batch_goes_to_the_models_device(tiny_backend):
    from transformers import AutoConfig, AutoModelForCausalLM

    from models.registry import resolve

    with torch.device("meta"):  # eager attention: the sdpa mask path reads mask values, which meta has not
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(resolve("tiny-random")),
                                                 attn_implementation="eager")
    backend = SimpleNamespace(name="meta-copy", tokenizer=tiny_backend.tokenizer, model=model)
    seen, handle = _record_inputs(model.get_decoder())
    try:
        vecs = policy_vectors(TEXTS, backend)
    finally:
        handle.remove()
    assert model.device == torch.device("meta")
    assert len(seen) >= 2 and set(seen) == {model.device}  # input_ids and attention_mask, moved
    assert vecs.device == model.device and tuple(vecs.shape) == (2, model.config.hidden_size)


def test_policy_vectors_are_masked_means_of_the_hidden_states(tiny_backend):
    decoder = tiny_backend.model.get_decoder()
    seen, handle = _record_inputs(decoder)
    try:
        batch = embed_policy(TEXTS, tiny_backend)
    finally:
        handle.remove()
    assert set(seen) == {tiny_backend.model.device}
    assert batch.dtype == np.float32 and batch.shape == (2, tiny_backend.model.config.hidden_size)
    np.testing.assert_allclose(np.linalg.norm(batch, axis=1), 1.0, rtol=1e-5)
    with torch.no_grad():  # the short text alone, unpadded: its plain mean over tokens
        ids = tiny_backend.tokenizer(TEXTS[0], return_tensors="pt")["input_ids"]
        mean = decoder(input_ids=ids).last_hidden_state[0].mean(0)
    np.testing.assert_allclose(batch[0], torch.nn.functional.normalize(mean, dim=0).numpy(), atol=1e-5)
    assert not np.allclose(batch[0], batch[1], atol=1e-3)  # the padding of the short text was masked out, and
    np.testing.assert_allclose(embed_policy(TEXTS[:1], tiny_backend)[0], batch[0], atol=1e-5)  # batching is moot


def test_policy_embedder_names_a_backend_without_hidden_states():
    with pytest.raises(ValueError, match="the policy embedder needs a transformers policy"):
        embed(["q"], "policy", SimpleNamespace(name="vllm:x", tokenizer=object()))
    with pytest.raises(ValueError, match="the policy embedder needs the policy backend"):
        embed(["q"], "policy", None)
