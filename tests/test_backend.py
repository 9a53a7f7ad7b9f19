import pytest
import torch
import torch.nn.functional as F

from models.backend import Backend, Sampling

PROMPTS = ["What is 2 + 3?", "Solve the following multiplication: 7 * 8. Give only the result.", "Hi"]


def _render(b, texts):
    return [b.render([{"role": "user", "content": t}]) for t in texts]


def test_implements_the_protocol(tiny_backend):
    assert isinstance(tiny_backend, Backend)


def test_generated_logprobs_match_a_direct_forward_pass(tiny_backend):
    b = tiny_backend
    prompts = _render(b, PROMPTS)
    out = b.generate(prompts, 3, Sampling(temperature=1.0, max_new_tokens=12, seed=1))
    for p, group in zip(prompts, out):
        for c in group:
            ids = b.encode([p])[0] + c.token_ids
            with torch.no_grad():
                logits = b.model(input_ids=torch.tensor([ids])).logits[0].float()
            logp = F.log_softmax(logits, -1)
            start = len(ids) - len(c.token_ids)
            direct = [logp[start - 1 + i, t].item() for i, t in enumerate(c.token_ids)]
            assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(direct), atol=1e-4)
            scored = b.score_ids([b.encode([p])[0]], [c.token_ids])[0]
            assert torch.allclose(torch.tensor(scored), torch.tensor(direct), atol=1e-4)


def test_score_chunks_do_not_change_the_result(tiny_backend):
    b = tiny_backend
    p, c = b.encode(_render(b, PROMPTS[:2])), b.encode(["The answer is 5.", "56, since 7 * 8 = 56"])
    whole = b.score_ids(p, c)
    old = b.score_chunk_tokens
    b.score_chunk_tokens = 3
    try:
        chunked = b.score_ids(p, c)
    finally:
        b.score_chunk_tokens = old
    for x, y in zip(whole, chunked):
        assert len(x) == len(y) and torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-5)


@pytest.mark.parametrize("batch_size,n", [(16, 3), (4, 2), (2, 1)])
def test_greedy_batched_equals_one_at_a_time(tiny_backend, batch_size, n):
    """Padding, the shared prefill, dropping finished rows and merging waiting prompts into a running batch
    (small batches force prompts of different lengths to merge into a running batch) must not change any row's tokens."""
    b = tiny_backend
    b.batch_size, old_batch = batch_size, b.batch_size
    prompts = _render(b, PROMPTS)
    greedy = Sampling(temperature=0.0, max_new_tokens=10)
    free = b.generate(prompts, 1, greedy)
    # make two rows stop at different steps, and let the third run to the length limit
    stops = {0: 3, 1: 6}
    old = b.eos_ids
    eos = [free[i][0].token_ids[k] for i, k in stops.items()]
    b.eos_ids = eos
    try:
        batched = b.generate(prompts, n, greedy)
        single = [b.generate([p], 1, greedy)[0][0] for p in prompts]
    finally:
        b.eos_ids, b.batch_size = old, old_batch
    for i, (group, one, ref) in enumerate(zip(batched, single, free)):
        cut = next((k for k, t in enumerate(ref[0].token_ids) if t in eos), None)
        expected = ref[0].token_ids[:cut] if cut is not None else ref[0].token_ids
        for c in [*group, one]:
            assert c.token_ids == expected, i
            assert c.finish_reason == ("stop" if cut is not None else "length")
            assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(one.logprobs), atol=1e-4)
    assert [len(g[0].token_ids) for g in batched][:2] == [3, 6]


def test_seeded_sampling_is_reproducible(tiny_backend):
    b = tiny_backend
    prompts = _render(b, PROMPTS)
    s = Sampling(temperature=0.9, top_p=0.95, max_new_tokens=8, seed=7)
    a, c = b.generate(prompts, 4, s), b.generate(prompts, 4, s)
    assert [[x.token_ids for x in g] for g in a] == [[x.token_ids for x in g] for g in c]
    d = b.generate(prompts, 4, Sampling(temperature=0.9, top_p=0.95, max_new_tokens=8, seed=8))
    assert [[x.token_ids for x in g] for g in a] != [[x.token_ids for x in g] for g in d]
    for x in (x for g in a for x in g):  # "length" exactly at the limit; "stop" only before it, its EOS not kept
        assert x.finish_reason in ("stop", "length") and (x.finish_reason == "length") == (x.n_tokens == 8)
        assert not set(x.token_ids) & set(b.eos_ids) and len(x.logprobs) == x.n_tokens
        assert all(lp <= 0 for lp in x.logprobs) and x.text == b.tokenizer.decode(x.token_ids, skip_special_tokens=True)


def test_bad_sampling_parameters_are_named():
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        Sampling(max_new_tokens=0)
