"""Weight gradients added into .grad in place (models/training/grad_into.py): autograd's gradients to float rounding,
tied and untied, accumulated over backward calls and over a GRPO round; no vocabulary-sized temporary in the
backward; the patch lasts only its block and steps aside where it would not be exact."""

import copy

import pytest
import torch
from conftest import assert_trains_alike, grpo_batch
from torch.utils._python_dispatch import TorchDispatchMode

from models.training.grad_into import grads_in_place, in_place_modules
from tasks.core.passes import completion_logprobs
from tasks.core.prefix import shared_completion_logprobs


def _untied(tiny_backend):
    from transformers import LlamaForCausalLM

    config = copy.deepcopy(tiny_backend.model.config)
    config.tie_word_embeddings = False
    torch.manual_seed(3)
    return LlamaForCausalLM(config).eval()


def _grads(model, passes, in_place: bool):
    """Every parameter's .grad after one backward per pass (accumulated), with or without the patch."""
    model.zero_grad(set_to_none=True)
    with grads_in_place(model, in_place):
        for fn in passes:
            logp, mask, _ = fn(model)
            (logp * mask * torch.linspace(-1, 1, logp.shape[1])).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [True, False])
def test_gradients_equal_autograds_over_accumulated_passes(tiny_backend, tied):
    """Two backward calls accumulate (a padded pass and a shared-prefix pass, the prompt padded with the pad id,
    which is the embedding's padding_idx and so gets no gradient): every parameter's gradient equals autograd's
    to float rounding."""
    b = tiny_backend
    model = copy.deepcopy(b.model) if tied else _untied(b)
    assert (model.get_input_embeddings().weight is model.get_output_embeddings().weight) == tied
    seqs = grpo_batch(b)
    pad = b.pad_id
    assert model.get_input_embeddings().padding_idx == pad
    prompts = [s.prompt_ids for s in seqs]
    prompts[3] = [pad, pad, *prompts[3]]  # the pad id inside a sequence: F.embedding gives its row no gradient
    comps = [s.completion_ids for s in seqs]
    passes = [lambda m: completion_logprobs(m, prompts, comps, pad, entropy=False, temperature=0.7),
              lambda m: shared_completion_logprobs(m, prompts[:2], comps[:2], pad, temperature=0.7)]
    plain, in_place = _grads(model, passes, False), _grads(model, passes, True)
    assert plain.keys() == in_place.keys()
    for n in plain:
        a, c = plain[n], in_place[n]
        assert torch.allclose(a, c, rtol=1e-5, atol=1e-6 * float(a.abs().max())), n
    if not tied:  # the output layer's gradient touches every row; the input side's only the tokens seen
        pad_row = model.get_input_embeddings().weight.grad[pad]  # the in-place pass ran last
        assert torch.equal(pad_row, torch.zeros_like(pad_row))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_grpo_round_gives_the_same_rows_and_weights(tiny_backend, dtype):
    """Two optimizer steps of GRPO + SFT with and without the patch, from the same weights (fp32, and under
    bf16 autocast): the same step rows and weights to float tolerance."""
    assert_trains_alike(tiny_backend, "grads_in_place", dtype)


class _Sizes(TorchDispatchMode):
    """Records the element count of every tensor an op returns, but for those in storages given (the .grad
    buffers an in-place op writes and returns)."""

    def __init__(self, existing: set[int]):
        super().__init__()
        self.existing = existing
        self.numels: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.existing:
                self.numels.append((func.__name__, t.numel()))
        return out


@pytest.mark.parametrize("in_place", [False, True])
def test_the_backward_builds_no_vocabulary_sized_tensor(tiny_backend, in_place):
    """The point of the module: with the patch, once .grad exists, no op of the backward returns a
    [vocabulary, hidden] tensor; autograd's backward returns several (the check can tell)."""
    b = tiny_backend
    model = copy.deepcopy(b.model)
    weight = model.get_input_embeddings().weight
    seqs = grpo_batch(b)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with grads_in_place(model, in_place):
        logp, mask, _ = completion_logprobs(model, [s.prompt_ids for s in seqs], [s.completion_ids for s in seqs],
                                            b.pad_id, temperature=0.7)
        sizes = _Sizes({p.grad.untyped_storage().data_ptr() for p in model.parameters()})
        with sizes:
            (logp * mask).sum().backward()
    vocab_sized = [name for name, n in sizes.numels if n == weight.numel()]
    assert (vocab_sized == []) == in_place, vocab_sized
    assert weight.grad.abs().sum() > 0


def test_the_patch_lasts_only_its_block_and_steps_aside(tiny_backend):
    model = copy.deepcopy(tiny_backend.model)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert [m for m, _ in in_place_modules(model)] == [emb, head]
    before = [m.__dict__.get("forward") for m in (emb, head)]  # the head may hold the backend's packed forward
    with pytest.raises(RuntimeError, match="inside"):
        with grads_in_place(model):
            assert [m.__dict__.get("forward") for m in (emb, head)] != before
            raise RuntimeError("inside")
    assert [m.__dict__.get("forward") for m in (emb, head)] == before
    with grads_in_place(model, enabled=False):
        assert [m.__dict__.get("forward") for m in (emb, head)] == before
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    with torch.no_grad():  # without gradients: the library's forward, bit for bit
        plain = model(ids).logits
        with grads_in_place(model):
            assert torch.equal(model(ids).logits, plain)
    with grads_in_place(model), torch.autocast("cpu", dtype=torch.bfloat16):  # a head under autocast: library's
        h = torch.randn(2, emb.weight.shape[1], requires_grad=True)
        assert head(h).grad_fn.name() != "_LinearIntoBackward"
    frozen = copy.deepcopy(tiny_backend.model)
    frozen.get_input_embeddings().weight.requires_grad_(False)  # tied: the head's weight is frozen too (LoRA)
    assert in_place_modules(frozen) == []
