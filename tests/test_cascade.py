"""Decode steps that attend to each shared prompt once (models/hf/cascade.py): the same tokens and log-probs as
SDPA over every row's copy, through the real decode loop with prompts of different lengths, continuous
batching (merges), rows leaving at different steps and whole prompts leaving; and a step with few rows per
prompt left stays on SDPA."""

import copy

import pytest
import torch

import models.hf.cascade as cascade
from models.backend import Sampling
from models.hf.cascade import SharedPrompts
from models.hf.decoding import fill_holes

QUESTIONS = ["What is 7 * 8?", "Add 3 and 4, then explain every step in detail, one by one.", "Count to five.",
             "Name a prime number above 100 and say why it is prime. " * 3, "Solve 2x + 3 = 11. " * 5]


@pytest.fixture
def backend(tiny_backend):
    """The tiny model with many end-of-sequence ids (about 1 token in 40 ends a row), so rows stop at scattered
    steps, and a batch of 6 rows, so prompts wait and merge in as rows leave."""
    b = copy.copy(tiny_backend)
    b.batch_size = 6
    vocab = b.model.config.vocab_size
    b.eos_ids = list(range(100, vocab, 40))
    return b


def _generate(b, share: bool, n: int):
    b.shared_prompt_attention = share
    ids = b.encode([b.render([{"role": "user", "content": q}]) for q in QUESTIONS])
    return b.generate_ids(ids, n, Sampling(0.9, 1.0, 40, 11), row_seeds=list(range(len(ids))))


def test_the_cascade_samples_what_sdpa_samples(backend, monkeypatch):
    monkeypatch.setattr(cascade, "MIN_ROWS", 1)  # every step with shared prompts takes the cascade
    monkeypatch.setattr(cascade, "MIN_ROWS_PER_PROMPT", 1)
    monkeypatch.setattr(cascade, "MIN_PROMPT_TOKENS", 1)
    taken = []
    real = SharedPrompts.attend
    monkeypatch.setattr(SharedPrompts, "attend", lambda self, *a: taken.append(1) or real(self, *a))
    plain, shared = _generate(backend, False, 3), _generate(backend, True, 3)
    assert taken, "the cascade never ran"
    lengths = sorted(len(c.token_ids) for cs in plain for c in cs)
    assert lengths[0] < 20 and lengths[-1] == 40, lengths  # rows left at different steps, some ran to the end
    for p_row, s_row in zip(plain, shared, strict=True):
        for p, s in zip(p_row, s_row, strict=True):
            assert p.token_ids == s.token_ids and p.finish_reason == s.finish_reason
            assert p.logprobs == pytest.approx(s.logprobs, abs=1e-4)


def test_a_step_with_few_rows_per_prompt_or_short_prompts_stays_on_sdpa():
    shared = SharedPrompts(n=8)
    shared.end = torch.zeros(8, dtype=torch.long)  # 8 prompts of 128 tokens
    shared.prompt_mask = torch.ones(8, 128, dtype=torch.bool)
    for rows, active in ((64, True), (32, True), (31, False), (24, False)):
        shared.group = torch.arange(rows) % 8
        shared.step(torch.ones(rows, 5))
        assert shared.active is active, rows
    shared.end = torch.zeros(2, dtype=torch.long)  # 2 prompts: 32 rows are 16 a prompt
    shared.prompt_mask = torch.ones(2, 128, dtype=torch.bool)
    shared.group = torch.arange(32) % 2
    shared.step(torch.ones(32, 5))
    assert shared.active
    shared.prompt_mask[:, :2] = False  # prompts of 126 tokens: SDPA's one pass is cheaper
    shared.step(torch.ones(32, 5))
    assert not shared.active
    shared.prompt_mask[:] = True
    shared.keys = [torch.zeros(2, 3, 128, 8)]  # a bf16 cache's prompts, kept in float32: the cascade computes in
    shared.half = True  # float32 (the test below), with the same thresholds on the CPU
    shared.step(torch.ones(32, 5))
    assert shared.active


def test_over_a_bf16_cache_the_cascade_attends_in_float32(monkeypatch):
    """A bf16 cache (the decoder on a CPU with native bf16, under bf16 autocast): the prompts are kept in
    float32, and a step's attention equals float32 SDPA over the same bf16 keys and values to float32 rounding,
    where bf16 products would be off by bf16 rounding; its bf16 output equals models/hf/decode_attention.py's."""
    from models.hf import decode_attention

    monkeypatch.setattr(cascade, "MIN_ROWS", 1)
    monkeypatch.setattr(cascade, "MIN_ROWS_PER_PROMPT", 1)
    monkeypatch.setattr(cascade, "MIN_PROMPT_TOKENS", 1)
    torch.manual_seed(2)
    kv, heads, dim, width, n = 3, 9, 64, 40, 4
    prompt_k, prompt_v = (torch.randn(2, kv, width, dim).bfloat16() for _ in range(2))
    shared = SharedPrompts(n=n)
    shared.add([(prompt_k, prompt_v)], torch.ones(2, width), shift=0, end=width)
    assert shared.half and shared.keys[0].dtype == torch.float32
    own = torch.randn(2 * n, kv, 3, dim).bfloat16()  # 2 generated tokens and this step's, per row
    keys = torch.cat([prompt_k.repeat_interleave(n, 0), own], 2)
    values = torch.cat([prompt_v.repeat_interleave(n, 0), torch.randn(2 * n, kv, 3, dim).bfloat16()], 2)
    mask = torch.ones(2 * n, width + 3)
    shared.step(mask)
    assert shared.active
    q = torch.randn(2 * n, heads, 1, dim).bfloat16()
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), keys.float(), values.float(),
                                                           enable_gqa=True).transpose(1, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as the decoder's steps run
        out = shared.attend(0, q, keys, values, dim ** -0.5)
        cast = decode_attention.attend(q, keys, values, None, dim ** -0.5)
    inner = shared.attend(0, q.float(), keys, values, dim ** -0.5)  # a float32 query: the float32 result
    assert out.dtype == torch.bfloat16 and inner.dtype == torch.float32
    assert (inner - ref).abs().max() < 1e-5
    assert torch.allclose(out.float(), cast.float(), atol=1e-2, rtol=0)
    assert torch.equal(out, inner.to(torch.bfloat16))


def test_one_sample_per_prompt_never_builds_shared_prompts(backend, monkeypatch):
    monkeypatch.setattr(cascade, "MIN_ROWS", 1)
    monkeypatch.setattr(cascade, "MIN_ROWS_PER_PROMPT", 1)
    monkeypatch.setattr(cascade, "MIN_PROMPT_TOKENS", 1)
    built = []
    monkeypatch.setattr(SharedPrompts, "add", lambda self, *a: built.append(1))
    _generate(backend, True, 1)
    assert built == []


def test_attend_equals_sdpa_after_a_wider_prompt_merged_and_a_row_left(monkeypatch):
    """SharedPrompts by hand: prompt A (5 tokens, 2 rows, 2 tokens generated), then prompt B (9 tokens, 2 rows),
    wider than the batch, so A's columns move right by 2; then one of A's rows leaves. One decode step's
    attention equals SDPA over each row's whole cache under its mask."""
    monkeypatch.setattr(cascade, "MIN_ROWS", 1)  # 3 rows over 2 prompts take the cascade here
    monkeypatch.setattr(cascade, "MIN_ROWS_PER_PROMPT", 1)
    monkeypatch.setattr(cascade, "MIN_PROMPT_TOKENS", 1)
    torch.manual_seed(0)
    kv, heads, dim, layers = 3, 9, 8, 2
    pa, pb = (torch.randn(layers, 2, 1, kv, p, dim) for p in (5, 9))  # keys, values of each prompt
    own_a = torch.randn(layers, 2, 2, kv, 2, dim)  # A's rows: 2 generated tokens each
    shared = SharedPrompts(n=2)
    shared.add([(pa[i, 0], pa[i, 1]) for i in range(layers)], torch.ones(1, 5), shift=0, end=5)
    # A's rows generate 2 tokens (its cache: 7 columns), then B merges: 9 columns, A's move right by 2
    shared.add([(pb[i, 0], pb[i, 1]) for i in range(layers)], torch.ones(1, 9), shift=9 - 7, end=9)
    assert shared.end.tolist() == [7, 9] and shared.group.tolist() == [0, 0, 1, 1]
    # the batch's cache: 4 rows x 10 columns (the step's own token last)
    keys, values = torch.zeros(layers, 4, kv, 10, dim), torch.zeros(layers, 4, kv, 10, dim)
    mask = torch.zeros(4, 10)
    for r in range(2):  # A: 2 padding columns, its prompt, its 2 tokens
        keys[:, r, :, 2:7], values[:, r, :, 2:7] = pa[:, 0, 0], pa[:, 1, 0]
        keys[:, r, :, 7:9], values[:, r, :, 7:9] = own_a[:, 0, r], own_a[:, 1, r]
        mask[r, 2:] = 1
    for r in (2, 3):
        keys[:, r, :, :9], values[:, r, :, :9] = pb[:, 0, 0], pb[:, 1, 0]
        mask[r] = 1
    keys[:, :, :, 9], values[:, :, :, 9] = torch.randn(2, layers, 4, kv, dim)
    keep = torch.tensor([1, 2, 3])  # A's first row leaves
    shared.keep(keep)
    keys, values, mask = keys[:, keep], values[:, keep], mask[keep]
    shared.step(mask)
    assert shared.active and not shared.full
    q = torch.randn(3, heads, 1, dim)
    for layer in range(layers):
        out = shared.attend(layer, q, keys[layer], values[layer], dim ** -0.5)
        ref = torch.nn.functional.scaled_dot_product_attention(q, keys[layer], values[layer],
                                                               attn_mask=mask.bool()[:, None, None, :],
                                                               enable_gqa=True).transpose(1, 2)
        assert torch.allclose(out, ref, atol=1e-6), (out - ref).abs().max()


def test_attend_equals_sdpa_after_a_whole_prompt_left_and_rows_moved_into_its_places(monkeypatch):
    """Prompts A, B, C (2 rows each); A's rows leave, and the decode batch moves C's rows into their places
    (models/hf/decoding.py fill_holes): rows C0, C1, B0, B1 are whole groups but not in group order, so the step
    must not take the [G, n] grid's shortcut. Attention equals SDPA over each row's cache."""
    monkeypatch.setattr(cascade, "MIN_ROWS", 1)
    monkeypatch.setattr(cascade, "MIN_ROWS_PER_PROMPT", 1)
    monkeypatch.setattr(cascade, "MIN_PROMPT_TOKENS", 1)
    torch.manual_seed(1)
    kv, heads, dim, width = 3, 9, 8, 6
    prompts = torch.randn(3, 2, 1, kv, width, dim)  # per prompt: keys, values
    shared = SharedPrompts(n=2)
    shared.add([(prompts[:, 0].reshape(3, kv, width, dim), prompts[:, 1].reshape(3, kv, width, dim))],
               torch.ones(3, width), shift=0, end=width)
    keys = torch.cat([prompts[:, 0].repeat_interleave(2, 0)[:, 0], torch.randn(6, kv, 1, dim)], 2)  # + the step's
    values = torch.cat([prompts[:, 1].repeat_interleave(2, 0)[:, 0], torch.randn(6, kv, 1, dim)], 2)
    order = torch.tensor(fill_holes([2, 3, 4, 5], 6))
    assert order.tolist() == [4, 5, 2, 3]
    shared.keep(order)
    keys, values, mask = keys[order], values[order], torch.ones(4, width + 1)
    shared.step(mask)
    assert shared.active and not shared.full
    q = torch.randn(4, heads, 1, dim)
    out = shared.attend(0, q, keys, values, dim ** -0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(q, keys, values, enable_gqa=True).transpose(1, 2)
    assert torch.allclose(out, ref, atol=1e-6), (out - ref).abs().max()
