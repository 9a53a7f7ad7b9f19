"""Memory-lean training passes (models/training/recompute.py): RMSNorms and gated MLPs keep only their inputs, the
gradients stay those of the library's forward, the patch lasts only its block, and a pass keeps fewer bytes."""

import copy

import pytest
import torch
from conftest import assert_trains_alike

from models.hf.packed import PackedForward
from models.training.recompute import lean_activations, lean_modules, rms_norm


def _saved_bytes(fn):
    """Bytes of the distinct non-parameter storages autograd keeps for the backward while `fn` runs."""
    kept: dict[int, int] = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, kept


def test_rms_norm_is_the_library_norm_bit_for_bit(tiny_backend):
    norm = tiny_backend.model.get_decoder().layers[0].input_layernorm
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 7, norm.weight.shape[0], generator=gen).to(dtype)
        assert torch.equal(rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))


def test_a_layer_gives_the_same_output_and_gradients_and_keeps_less(tiny_backend):
    """One decoder layer, library forward against lean, from the same input: equal outputs bit for bit, equal
    gradients (input and every weight) to float rounding (about 3e-7 relative: the rerun's gradient reaches the
    residual stream as one sum where the library's adds up op by op), and the lean pass keeps
    (2 x hidden + intermediate) floats per token fewer."""
    model = copy.deepcopy(tiny_backend.model).train()
    layer = model.get_decoder().layers[0]
    cfg = model.config
    x0 = torch.randn(2, 9, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(9)[None].expand(2, -1)
    rope = model.get_decoder().rotary_emb(x0, pos)
    results = []
    for lean in (False, True):
        layer.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        with lean_activations(layer, lean):
            out, kept = _saved_bytes(lambda x=x: layer(x, position_embeddings=rope, attention_mask=None))
        out = out[0] if isinstance(out, tuple) else out
        kept_bytes = sum(n for ptr, n in kept.items()
                         if ptr not in {p.untyped_storage().data_ptr() for p in layer.parameters()})
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}, kept_bytes))
    (o0, gx0, g0, kept0), (o1, gx1, g1, kept1) = results
    assert torch.equal(o0, o1)
    assert g0.keys() == g1.keys()
    for a, b in [(gx0, gx1), *((g0[n], g1[n]) for n in g0)]:
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6 * float(a.abs().max()))
    fewer = 2 * 9 * (2 * cfg.hidden_size + cfg.intermediate_size) * 4  # tokens x floats x fp32
    assert kept0 - kept1 >= fewer, (kept0, kept1, fewer)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_train_round_rows_and_weights_match_the_library_forward(tiny_backend, dtype):
    """Two optimizer steps of GRPO + SFT, lean against the library's forward from the same weights (fp32, and
    under bf16 autocast): the same step rows and weights to float tolerance."""
    assert_trains_alike(tiny_backend, "lean_activations", dtype)


def test_the_patch_lasts_only_its_block(tiny_backend):
    def patched(model):  # a forward set on a module, beside the backend's packed linears (models/hf/packed.py)
        return any(not isinstance(m.__dict__.get("forward"), (type(None), PackedForward)) for m in model.modules())

    model = copy.deepcopy(tiny_backend.model)
    found = [m for m, _ in lean_modules(model)]
    layers = model.config.num_hidden_layers
    assert len(found) == 3 * layers + 1  # two norms and an MLP per layer, and the final norm
    assert not patched(model)
    with pytest.raises(RuntimeError, match="inside"):
        with lean_activations(model):
            assert all("forward" in m.__dict__ for m in found)
            raise RuntimeError("inside")
    assert not patched(model)
    with lean_activations(model, enabled=False):
        assert not patched(model)


def test_without_grad_the_lean_forward_is_the_library_forward(tiny_backend):
    model = copy.deepcopy(tiny_backend.model).eval()
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    with torch.no_grad():
        plain = model(ids).logits
        with lean_activations(model):
            lean = model(ids).logits
    assert torch.equal(plain, lean)
