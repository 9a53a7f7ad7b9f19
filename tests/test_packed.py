"""models/hf/packed.py: oneDNN's packed linears serve the decode steps, equal F.linear to float rounding, repack
when a weight changes, and step aside for gradients, wide calls, handed-in models and weights neither fp32 nor
bf16 (bf16 where oneDNN computes it natively)."""

import pytest
import torch
import torch.nn.functional as F

from models.devices import native_bf16
from models.hf import packed


def _layer(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(48, 80)


needs_onednn = pytest.mark.skipif(packed.usable("cpu", torch.nn.Linear(2, 2)) is not None,
                                  reason="torch without oneDNN's packed linear")


@needs_onednn
def test_packed_forward_equals_f_linear_for_decode_rows_and_steps_aside_otherwise():
    layer = _layer()
    fwd = packed.PackedForward(layer)
    with torch.no_grad():
        for shape in [(1, 48), (4, 1, 48), (packed.MAX_ROWS, 48)]:
            x = torch.randn(*shape)
            torch.testing.assert_close(fwd(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        assert fwd.packed is not None  # the packed kernel ran
        fwd.packed = "would fail if used"  # wide calls and calls with gradients do not touch it
        x = torch.randn(packed.MAX_ROWS + 1, 48)
        assert torch.equal(fwd(x), F.linear(x, layer.weight, layer.bias))
    x = torch.randn(3, 48, requires_grad=True)
    fwd(x).sum().backward()  # F.linear: the gradient flows
    assert x.grad is not None and layer.weight.grad is not None


@needs_onednn
def test_a_weight_written_in_place_is_packed_again():
    layer = _layer()
    fwd = packed.PackedForward(layer)
    x = torch.randn(2, 48)
    with torch.no_grad():
        before = fwd(x)
        layer.weight.mul_(2.0)  # an optimizer step or a checkpoint load writes the weight in place
        after = fwd(x)
    torch.testing.assert_close(after, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(after, before)


@needs_onednn
def test_backend_installs_it_on_its_own_fp32_cpu_model_only():
    from models.backend import Sampling
    from models.hf.backend import TransformersBackend
    from models.registry import resolve

    own = TransformersBackend(resolve("tiny-random"), dtype="fp32")
    assert own.packed_decode and packed.installed(own.model)
    ids = [[5, 6, 7, 8], [9, 10, 11]]
    sampled = own.generate_ids(ids, 2, Sampling(0.7, 1.0, 6, 0), row_seeds=[1, 2])
    # the same model object, handed in (as a trainer shares it): not patched, and its samples the same
    packed.uninstall(own.model)
    shared = TransformersBackend(resolve("tiny-random"), dtype="fp32", model=own.model, tokenizer=own.tokenizer)
    assert not shared.packed_decode and not packed.installed(shared.model)
    again = shared.generate_ids(ids, 2, Sampling(0.7, 1.0, 6, 0), row_seeds=[1, 2])
    assert [[c.token_ids for c in g] for g in sampled] == [[c.token_ids for c in g] for g in again]
    for g, h in zip(sampled, again):
        for c, d in zip(g, h):
            assert c.logprobs == pytest.approx(d.logprobs, abs=1e-4)


@needs_onednn
def test_a_patched_model_deep_copies_and_the_copy_packs_its_own_weights():
    import copy

    model = torch.nn.Sequential(_layer())
    assert packed.install(model, "cpu")
    x = torch.randn(2, 48)
    with torch.no_grad():
        model(x)  # packed now: an opaque oneDNN tensor, which deepcopy cannot copy
        twin = copy.deepcopy(model)
        twin[0].weight.mul_(3.0)
        torch.testing.assert_close(twin(x), F.linear(x, twin[0].weight, twin[0].bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(x), F.linear(x, model[0].weight, model[0].bias), rtol=1e-5, atol=1e-5)
    assert twin[0].forward.layer is twin[0]


def test_usable_names_why_not():
    assert packed.usable("cuda", torch.nn.Linear(2, 2)) == "device cuda"
    assert packed.usable("cpu", torch.nn.Linear(2, 2).half()) == "weights not all fp32 or all bf16 (float16)"
    mixed = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).to(torch.bfloat16))
    assert packed.usable("cpu", mixed) == "weights not all fp32 or all bf16 (bfloat16, float32)"
    assert packed.install(mixed, "cpu") is False and not packed.installed(mixed)
    if not native_bf16("cpu"):
        bf16 = torch.nn.Sequential(torch.nn.Linear(2, 2).to(torch.bfloat16))
        assert packed.usable("cpu", bf16) == "no native bf16 on this CPU (oneDNN would emulate it)"
        assert packed.install(bf16, "cpu") is False and not packed.installed(bf16)


needs_onednn_bf16 = pytest.mark.skipif(packed.usable("cpu", torch.nn.Linear(2, 2).to(torch.bfloat16)) is not None,
                                       reason="no native bf16 on this CPU")


@needs_onednn_bf16
def test_bf16_weights_pack_too_and_match_f_linear():
    """bf16 weights (the decode model where the CPU computes bf16) take the packed product for bf16 rows; wide
    calls and rows with gradients go to F.linear."""
    layer = _layer().to(torch.bfloat16)
    fwd = packed.PackedForward(layer)
    with torch.no_grad():
        for shape in [(1, 48), (3, 1, 48), (packed.MAX_ROWS, 48)]:
            x = torch.randn(*shape).to(torch.bfloat16)
            torch.testing.assert_close(fwd(x), F.linear(x, layer.weight, layer.bias), rtol=1e-2, atol=1e-2)
        assert fwd.packed is not None  # the packed kernel ran
        fwd.packed = "would fail if used"  # wide calls and calls with gradients do not touch it
        x = torch.randn(packed.MAX_ROWS + 1, 48).to(torch.bfloat16)
        assert torch.equal(fwd(x), F.linear(x, layer.weight, layer.bias))
    x = torch.randn(3, 48).to(torch.bfloat16).requires_grad_()
    fwd(x).float().sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


@needs_onednn_bf16
def test_backend_packs_its_own_bf16_model():
    from models.backend import Sampling
    from models.hf.backend import TransformersBackend
    from models.registry import resolve

    own = TransformersBackend(resolve("tiny-random"), dtype="bf16")
    assert own.packed_decode and packed.installed(own.model)
    ids = [[5, 6, 7, 8], [9, 10, 11]]
    sampled = own.generate_ids(ids, 2, Sampling(0.0, 1.0, 6, 0))
    packed.uninstall(own.model)
    again = own.generate_ids(ids, 2, Sampling(0.0, 1.0, 6, 0))
    assert [[c.token_ids for c in g] for g in sampled] == [[c.token_ids for c in g] for g in again]
    for g, h in zip(sampled, again):
        for c, d in zip(g, h):
            assert c.logprobs == pytest.approx(d.logprobs, abs=1e-2)
