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


def _direct(b, prompt: str, token_ids: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of one full forward pass, gathered at the sampled tokens."""
    ids = b.encode([prompt])[0] + token_ids
    with torch.no_grad():
        logits = b.model(input_ids=torch.tensor([ids])).logits[0].float()
    start = len(ids) - len(token_ids)
    logp = F.log_softmax(logits / temperature, -1)
    return logp[start - 1 : len(ids) - 1].gather(1, torch.tensor(token_ids)[:, None])[:, 0]


@pytest.mark.parametrize("temperature,top_p,direct_t", [(0.7, 1.0, 0.7), (0.7, 0.9, 0.7), (0.0, 1.0, 1.0)])
def test_generated_logprobs_describe_the_sampling_distribution(tiny_backend, temperature, top_p, direct_t):
    """What `generate` returns (and the collect stage stores in `rollouts`) is log_softmax(logits / T) of the
    sampled tokens: the distribution they were drawn from, before top-p truncation (as the trainer recomputes
    it), and the unmodified model's at T = 0 (greedy). They agree with the trainer's own log-probs at the same
    T (tasks.core.grpo.completion_logprobs) and with `score_ids(temperature=T)`."""
    from tasks.core.passes import completion_logprobs

    b = tiny_backend
    prompts = _render(b, PROMPTS)
    out = b.generate(prompts, 2, Sampling(temperature=temperature, top_p=top_p, max_new_tokens=10, seed=5))
    flat = [(p, c) for p, g in zip(prompts, out) for c in g if c.token_ids]
    p_ids = [b.encode([p])[0] for p, _ in flat]
    trainer, _, _ = completion_logprobs(b.model, p_ids, [c.token_ids for _, c in flat], b.pad_id,
                                        temperature=temperature)
    scored = b.score_ids(p_ids, [c.token_ids for _, c in flat], temperature=temperature)
    for r, (p, c) in enumerate(flat):
        stored = torch.tensor(c.logprobs)
        assert torch.allclose(stored, _direct(b, p, c.token_ids, direct_t), atol=1e-4)
        assert torch.allclose(stored, trainer[r, : len(c.token_ids)], atol=1e-4)
        assert torch.allclose(stored, torch.tensor(scored[r]), atol=1e-4)
    if temperature:
        at_1 = torch.cat([_direct(b, p, c.token_ids, 1.0) for p, c in flat])
        assert (torch.cat([torch.tensor(c.logprobs) for _, c in flat]) - at_1).abs().max() > 0.01


def test_scoring_after_an_empty_prompt_is_refused_by_name(tiny_backend):
    """An empty prompt gives a completion's first token no context: it used to be read off position -1 (the
    padded row's last column), a silently wrong log-prob."""
    b = tiny_backend
    c = b.encode(["The answer is 5."])
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        b.score_ids([b.encode(_render(b, PROMPTS[:1]))[0], []], c * 2)
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        b.score_ids([[1], [2]], c)
    assert b.score_ids([[]], [[]]) == [[]]  # nothing to score is not an error


def test_score_is_the_unmodified_model_unless_a_temperature_is_given(tiny_backend):
    """`score` (the gate's fluency, MCMC's target pi_ref) stays at T = 1; `score_ids(temperature=T)` scales."""
    b = tiny_backend
    p, c = _render(b, PROMPTS[:1]), ["The answer is 5."]
    (at_1,) = b.score(p, c)
    assert torch.allclose(torch.tensor(at_1), _direct(b, p[0], b.encode(c)[0], 1.0), atol=1e-4)
    (at_05,) = b.score_ids(b.encode(p), b.encode(c), temperature=0.5)
    assert torch.allclose(torch.tensor(at_05), _direct(b, p[0], b.encode(c)[0], 0.5), atol=1e-4)
    with pytest.raises(ValueError, match="temperature"):
        b.score_ids(b.encode(p), b.encode(c), temperature=-1.0)


def test_scripted_logprobs_follow_the_sampling_temperature(scripted):
    """The scripted policy's completions carry the wrapped model's log-probs at the sampling temperature, as
    the transformers backend's do."""
    b = scripted
    prompts = _render(b, ["What is 7 * 8?"])
    (group,) = b.generate(prompts, 2, Sampling(temperature=0.6, max_new_tokens=32, seed=1))
    for c in group:
        assert torch.allclose(torch.tensor(c.logprobs), _direct(b, prompts[0], c.token_ids, 0.6), atol=1e-4)


def test_lope_behaviour_logprob_is_the_trainers_at_the_sampling_temperature(tiny_backend):
    """A LoPE replacement stores its behaviour mean log-prob (the generate call's, under the perturbed prompt);
    it equals the trainer's mean log-prob of the same tokens under the recorded behaviour prompt at the round's
    temperature, so the behaviour ratio's two sides describe the same distribution."""
    import json

    from tasks.core.lope import lope_rescue
    from tasks.core.passes import completion_logprobs

    b = tiny_backend
    messages = [[{"role": "user", "content": "What is 7 * 8?"}]]
    groups = b.generate([b.render(messages[0])], 4, Sampling(0.7, 1.0, 8, seed=2))
    augmentation = [[None] * 4]
    stats = lope_rescue(b, messages, [[False] * 4], groups, augmentation, Sampling(0.7, 1.0, 8, seed=2),
                        verify_one=lambda i, text: (1.0, True), n_prefixes=2, per_prefix=2)
    assert stats.replaced == 3
    for slot in (1, 2, 3):
        c = groups[0][slot]
        lope = json.loads(augmentation[0][slot])["lorem_perturb"]
        behaviour = b.encode([lope["behaviour_prompt"]])[0]
        lp, _, _ = completion_logprobs(b.model, [behaviour], [c.token_ids], b.pad_id, temperature=0.7)
        assert lope["behaviour_mean_logprob"] == pytest.approx(float(lp[0].detach().mean()), abs=1e-4)


def test_the_kv_cache_goes_by_the_keyword_the_installed_transformers_takes():
    """transformers 5.20 renamed forward's `past_key_values` to `cache`; the other name is swallowed by
    **kwargs, so the cache stayed empty and every decode step saw only its last token (on the H200 with
    transformers 5.17, generate's log-probs were off by up to 13 nats from a plain forward)."""
    import torch

    from models.hf.decoding import cache_kwarg

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs): ...

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs): ...

    assert (cache_kwarg(Old()), cache_kwarg(New())) == ("past_key_values", "cache")


def test_generate_reports_the_log_probs_a_plain_forward_gives(tiny_backend):
    """Each sampled token's reported log-prob is the model's at that position given everything before it:
    checked against one unbatched, uncached forward of prompt + completion."""
    import torch

    from models.backend import Sampling

    b = tiny_backend
    ids = b.encode([b.render([{"role": "user", "content": f"What is {i} + {i}?" + " Think." * i}]) for i in range(3)])
    out = b.generate_ids(ids, 2, Sampling(0.7, 1.0, 10, 0), row_seeds=[0, 1, 2])
    for p, group in zip(ids, out):
        for c in group:
            x = torch.tensor([p + c.token_ids])
            with torch.no_grad():
                logits = b.model(x).logits[0, len(p) - 1:-1].float() / 0.7
            plain = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            assert torch.allclose(torch.tensor(c.logprobs), plain, atol=1e-4)


def test_the_kv_budget_bounds_the_rows_decoding_together_without_changing_them(tiny_backend, monkeypatch):
    """With `kv_cache_gib` too small for all rows at once, fewer rows decode together (every cache buffer
    fits the budget, or holds one prompt's samples alone) and each row draws the same tokens (keyed sampling)."""
    from models.hf.decoding import BufferedLayer

    b = tiny_backend
    prompts = _render(b, [*PROMPTS, "Lorem ipsum dolor sit amet. " * 12 + "What is 4 + 4?", "Name a prime."])
    widest = max(len(p) for p in b.encode(prompts))
    s = Sampling(temperature=0.9, max_new_tokens=8, seed=3)
    seeds = list(range(100, 100 + len(prompts)))
    buffers: list[tuple[int, int]] = []  # (rows, columns in use) of every buffer a merge builds
    made = BufferedLayer.of.__func__

    def recorded(cls, parts, spare):
        layer = made(cls, parts, spare)
        buffers.append((layer.kbuf.shape[0], layer.end))
        return layer
    monkeypatch.setattr(BufferedLayer, "of", classmethod(recorded))
    free = b.generate(prompts, 2, s, row_seeds=seeds)
    assert max(r for r, _ in buffers) == 2 * len(prompts)  # unbounded: every row at once
    buffers.clear()
    old = b.kv_cache_bytes
    b.kv_cache_bytes = 4 * (widest + s.max_new_tokens) * b.kv_bytes_per_token  # 4 rows as wide as the widest
    try:
        assert b.rows_within(widest, s.max_new_tokens) == 4
        bounded = b.generate(prompts, 2, s, row_seeds=seeds)
        b.kv_cache_bytes = 1  # less than one prompt's samples: they are still admitted, alone
        alone = b.generate(prompts, 2, s, row_seeds=seeds)
    finally:
        b.kv_cache_bytes = old
    assert buffers and max(r for r, w in buffers if w >= widest) == 4  # the widest rows: 4 at a time
    assert all(r * w <= 4 * (widest + s.max_new_tokens) or r == 2 for r, w in buffers)  # narrower: more rows
    for out in (bounded, alone):
        assert [[c.token_ids for c in g] for g in out] == [[c.token_ids for c in g] for g in free]
        for g, ref in zip(out, free):
            for c, r in zip(g, ref):
                assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(r.logprobs), atol=1e-4)


def test_the_kv_budget_counts_the_caches_real_size(tiny_backend):
    """kv_bytes_per_token is what a prefilled cache holds per token and row: layers x (keys, values)."""
    b = tiny_backend
    batch, _ = b._prefill(b.encode(_render(b, PROMPTS[:1])), 1)
    held = sum(t.numel() * t.element_size() for layer in batch.cache.layers for t in (layer.keys, layer.values))
    assert held == batch.mask.shape[1] * b.kv_bytes_per_token


def test_generate_and_score_samples_as_generate_and_scores_as_score(tiny_backend):
    """The fused prefill (MCMC's proposal with the reverse move's q): the same keyed samples as
    `generate_ids`, and each prompt's continuation scored as `score_ids` scores it, for continuations of
    different lengths (one empty) after prompts of different lengths."""
    b = tiny_backend
    prompts = b.encode(_render(b, PROMPTS))
    after = b.encode(["The answer is 5.", "56", ""])
    s = Sampling(1.0, 1.0, 12, 5)
    fused, scores = b.generate_and_score_ids(prompts, after, s, row_seeds=[3, 4, 5])
    plain = b.generate_ids(prompts, 1, s, row_seeds=[3, 4, 5])
    assert [g[0].token_ids for g in fused] == [g[0].token_ids for g in plain]
    for f, p in zip(fused, plain):
        assert torch.allclose(torch.tensor(f[0].logprobs), torch.tensor(p[0].logprobs), atol=1e-5)
    assert scores[2] == []
    for x, y in zip(scores, b.score_ids(prompts, after)):
        assert len(x) == len(y) and torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-5)
    with pytest.raises(ValueError, match="3 prompts but 2 continuations"):
        b.generate_and_score_ids(prompts, after[:2], s)


def test_sequence_states_score_as_score_and_sample_as_generate(tiny_backend):
    """Kept sequence states (models/hf/states.py): opening scores as `score_ids`; extending a prefix of a state
    (and then the extended state) scores its continuation as `score_ids` scores it after the full prefix; and
    sampling from a prefix of a state draws the keyed samples `generate_ids` draws from that prefix. Rows of
    different lengths, cut inside the prompt, inside the completion and at the end. A cut outside its state,
    or an empty prompt, is a one-line error."""
    b = tiny_backend
    prompts = b.encode(_render(b, PROMPTS))
    comps = b.encode(["The answer is 5.", "56", "Because seven eights are fifty-six, then"])
    states, lps = b.open_states(prompts, comps)
    for x, y in zip(lps, b.score_ids(prompts, comps)):
        assert len(x) == len(y) and torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-5)
    cuts = [len(prompts[0]) - 2, len(prompts[1]) + 1, len(prompts[2]) + len(comps[2])]
    conts = b.encode([" so 5.", " and 8 squared", "!"])
    grown, lps = b.extend_states(states, cuts, conts)
    for x, y in zip(lps, b.score_ids([s.ids[:c] for s, c in zip(states, cuts)], conts)):
        assert len(x) == len(y) and torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-5)
    assert [g.ids for g in grown] == [s.ids[:c] + t for s, c, t in zip(states, cuts, conts)]
    again, lps = b.extend_states(grown, [len(g) for g in grown], [[7, 8, 9]] * 3)
    for x, y in zip(lps, b.score_ids([g.ids for g in grown], [[7, 8, 9]] * 3)):
        assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-5)
    s = Sampling(1.0, 1.0, 12, 5)
    at = [len(again[0]) - 4, 3, len(again[2])]
    kept = b.generate_from_states(again, at, s, row_seeds=[3, 4, 5])
    plain = b.generate_ids([g.ids[:c] for g, c in zip(again, at)], 1, s, row_seeds=[3, 4, 5])
    assert [g[0].token_ids for g in kept] == [g[0].token_ids for g in plain]
    for k, p in zip(kept, plain):
        assert torch.allclose(torch.tensor(k[0].logprobs), torch.tensor(p[0].logprobs), atol=1e-5)
    with pytest.raises(ValueError, match="cut 99 of row 0 is outside its state"):
        b.extend_states(states[:1], [99], [[5]])
    with pytest.raises(ValueError, match="at least one token"):
        b.generate_from_states(states[:1], [0], s)
    with pytest.raises(ValueError, match="empty prompt"):
        b.open_states([[]], [[5]])


def test_streamed_requests_sample_what_each_samples_alone(tiny_backend):
    """`stream_from_states`: requests that join the running batch as earlier rows finish (MCMC's chains) draw
    the keyed samples each would draw alone, and every request's Completion comes back, numbered in the order
    the requests were made. Seeds are given for all requests or none: a one-line error otherwise."""
    b = tiny_backend
    prompts = b.encode(_render(b, PROMPTS))
    states, _ = b.open_states(prompts, b.encode(["The answer is 5.", "56", "Because seven eights"]))
    s = Sampling(1.0, 1.0, 10, 0)
    made = [(states[r % 3], len(states[r % 3]) - r, 100 + r) for r in range(8)]
    queue, seen = list(made[3:]), []

    def on_done(rows):
        seen.append([num for num, _ in rows])
        return [queue.pop(0) for _ in rows if queue]

    before = b.decode_steps
    out = b.stream_from_states(made[:3], s, on_done)
    assert sorted(n for batch in seen for n in batch) == list(range(8)) and len(out) == 8
    assert len(seen) >= 3 and b.decode_steps - before >= 10  # requests joined after the first ones finished
    for (st, cut, seed), got in zip(made, out):
        alone = b.generate_ids([st.ids[:cut]], 1, s, row_seeds=[seed])[0][0]  # prefilled, not from the state
        assert got.token_ids == alone.token_ids and got.finish_reason == alone.finish_reason
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(alone.logprobs), atol=1e-5)
    with pytest.raises(ValueError, match="a row seed for every request or for none"):
        b.stream_from_states(made[:1], s, lambda rows: [(states[0], 2, None)])
