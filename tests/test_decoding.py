"""The decode loop's pieces (models/hf/decoding.py): exact inverse-CDF sampling, keyed uniforms, and the
preallocated KV cache checked against plain concatenation."""

import pytest
import torch

from models.hf.decoding import BufferedLayer, draw, fill_holes, keyed_uniforms, sample_cdf


def _grid(n: int) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float64) + 0.5) / n


def test_inverse_cdf_draws_each_token_in_proportion_to_its_probability():
    """A grid of N uniforms must draw token v about p_v * N times (off by at most one per block edge), with
    a vocabulary that is not a whole number of blocks, zeros inside and at the end, and unnormalised mass."""
    gen = torch.Generator().manual_seed(0)
    vocab, n = 300, 200_000
    probs = torch.rand(vocab, generator=gen) ** 4
    probs[[0, 7, 255, 256, 299]] = 0  # zeros at both ends and at the block boundary
    probs = probs * 3.7
    tokens = sample_cdf(probs.expand(n, vocab).contiguous(), _grid(n), block=256)
    counts = torch.bincount(tokens, minlength=vocab).double()
    expected = probs.double() / probs.double().sum() * n
    assert (counts - expected).abs().max() <= 2
    assert counts[[0, 7, 255, 256, 299]].sum() == 0


def test_the_top_of_the_mass_lands_on_the_last_possible_token():
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0]])
    u = torch.tensor([1 - 1e-16], dtype=torch.float64)
    assert sample_cdf(probs, u, block=2).tolist() == [2]
    assert sample_cdf(probs, torch.tensor([0.0]), block=2).tolist() == [1]
    assert sample_cdf(probs, torch.tensor([1.0]), block=2).tolist() == [2]  # even u = 1 (float32 rounding)


@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (1.3, 0.8), (0.0, 1.0)])
def test_draw_reports_log_probs_of_the_sampling_distribution(temperature, top_p):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 1000, generator=gen) * 3
    u = torch.rand(64, generator=gen, dtype=torch.float64)
    tok, lp = draw(logits, temperature, top_p, u)
    t = temperature if temperature > 0 else 1.0
    ref = torch.log_softmax(logits / t, -1)
    assert torch.allclose(lp, ref.gather(1, tok[:, None])[:, 0], atol=1e-5)
    if temperature == 0:
        assert torch.equal(tok, logits.argmax(-1))
    if top_p < 1:  # every drawn token is inside the nucleus: the mass of the tokens ranked above it < top_p
        p = ref.exp()
        above = (p * (p > p.gather(1, tok[:, None]))).sum(-1)
        assert (above < top_p).all()


def test_keyed_uniforms_are_a_pure_function_of_the_key_and_spread_evenly():
    keys = torch.tensor([[s, j, pos] for s in range(20) for j in range(10) for pos in range(50)])
    u = keyed_uniforms(keys)
    assert torch.equal(u, keyed_uniforms(keys.flip(0)).flip(0))  # same key, same uniform, in any batch order
    assert ((u > 0) & (u < 1)).all() and u.unique().numel() == len(u)
    sorted_u = u.sort().values  # Kolmogorov-Smirnov distance to uniform, well inside the 1% bound for n = 10000
    ecdf = torch.arange(1, len(u) + 1, dtype=torch.float64) / len(u)
    assert (ecdf - sorted_u).abs().max() < 1.63 / len(u) ** 0.5


def test_the_buffered_cache_holds_what_concatenation_would():
    """Merging rows of different widths (with repeats), decode steps, leading columns dropped, rows leaving
    (moved in place), rows appended where rows left (after leading columns were dropped), and running out of
    spare columns: the buffered layer's keys and values always equal a reference built with torch.cat and
    indexing, and a step with spare room writes in place."""
    gen = torch.Generator().manual_seed(2)

    def kv(b, w):
        return torch.randn(b, 3, w, 4, generator=gen), torch.randn(b, 3, w, 4, generator=gen)

    (k1, v1), (k2, v2) = kv(2, 5), kv(3, 3)
    layer = BufferedLayer.of([(k1, v1, 1), (k2, v2, 2)], spare=2)

    def pad(t, w):
        return torch.cat([torch.zeros(t.shape[0], 3, w - t.shape[2], 4), t], 2)

    ref_k = torch.cat([k1, pad(k2, 5).repeat_interleave(2, 0)])
    ref_v = torch.cat([v1, pad(v2, 5).repeat_interleave(2, 0)])
    assert torch.equal(layer.keys, ref_k) and torch.equal(layer.values, ref_v)
    for step in range(5):
        k, v = kv(ref_k.shape[0], 1)
        before = layer.kbuf.data_ptr()
        spare = layer.kbuf.shape[2] - layer.end
        out_k, out_v = layer.update(k, v)
        ref_k, ref_v = torch.cat([ref_k, k], 2), torch.cat([ref_v, v], 2)
        assert torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v)
        assert (layer.kbuf.data_ptr() == before) == (spare >= 1)
        assert layer.get_seq_length() == ref_k.shape[2] and layer.get_mask_sizes(1) == (ref_k.shape[2] + 1, 0)
        if step == 0:  # rows 1, 2, 4, 5 and 6 of 8 leave: 3 and 7 take the places of 1 and 2, in place
            layer.drop_leading(1)  # the appended rows then start at an offset column
            ref_k, ref_v = ref_k[:, :, 1:], ref_v[:, :, 1:]
            order, buffer = fill_holes([0, 3, 7], 8), layer.kbuf.data_ptr()
            layer.move_rows(torch.tensor([1, 2]), torch.tensor(order[1:]), 3)
            ref_k, ref_v = ref_k[order], ref_v[order]
            assert layer.room() == 5
            k3, v3 = kv(1, 4)  # a prompt prefilled later, narrower: its 2 rows go where rows left, in place
            layer.append_rows(k3, v3, 2)
            ref_k = torch.cat([ref_k, pad(k3, ref_k.shape[2]).repeat_interleave(2, 0)])
            ref_v = torch.cat([ref_v, pad(v3, ref_v.shape[2]).repeat_interleave(2, 0)])
            assert layer.kbuf.data_ptr() == buffer and layer.kbuf.shape[0] == 8 and layer.room() == 3
        if step == 2:
            layer.drop_leading(2)
            ref_k, ref_v = ref_k[:, :, 2:], ref_v[:, :, 2:]
        assert torch.equal(layer.keys, ref_k) and torch.equal(layer.values, ref_v)
