"""Shared-prefix GRPO (tasks/core/prefix.py): the same log-probs, loss, gradients and step rows as the unshared
forward over prompt + completion, with LoPE rows' behaviour prompts and lone prompts kept apart, and micro-batches
that count a prompt once."""

import copy

import pytest
import torch

from tasks.core.advantages import group_advantages
from tasks.core.grpo import Sequence, TrainConfig, TrainPlan, train_round
from tasks.core.passes import completion_logprobs
from tasks.core.prefix import prompt_groups, shared_completion_logprobs, shared_micro_batches

CFG = TrainConfig(lr=1e-6, weight_decay=0.0, kl_coef=0.05, sft_weight=0.5, rows_per_step=64, micro_batch=32,
                  micro_tokens=10_000_000, max_grad_norm=1e6)
RTOL, ATOL = 1e-4, 1e-6


def _batch(b) -> tuple[list[Sequence], list[Sequence]]:
    """Two groups of G = 4 (the second with one LoPE row sampled under a Lorem system prompt), one lone row
    under a prompt of its own, and two SFT traces on one prompt; completions of different lengths."""
    def prompt(q, system=None):
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": q}]
        return b.encode([b.render(msgs)])[0]

    pa, pb, lone = prompt("What is 7 * 8?"), prompt("Sum 3 and 4, then double it."), prompt("Hi")
    lorem = prompt("Sum 3 and 4, then double it.", "Lorem ipsum dolor sit amet, consectetur.")
    comps_a = b.encode(["It is 54.", "Maybe 55", "7 * 8 = 56, so \\boxed{56}", "The answer is \\boxed{56}."])
    comps_b = b.encode(["14", "3 + 4 = 7 and 7 * 2 = 14: \\boxed{14}", "It is 12.", "\\boxed{14}"])
    seqs = [Sequence(pa, c, a) for c, a in zip(comps_a, group_advantages([0.0, 0.0, 1.0, 1.0]))]
    seqs += [Sequence(pb, c, a, lorem if j == 1 else None)
             for j, (c, a) in enumerate(zip(comps_b, group_advantages([1.0, 1.0, 0.0, 1.0])))]
    seqs.append(Sequence(lone, b.encode(["Hello there."])[0], 0.7))
    sft = [Sequence(pa, c + [b.tokenizer.eos_token_id], 0.0) for c in b.encode(["7 * 8 = 56", "\\boxed{56}"])]
    return seqs, sft


def _reference(b):
    ref = copy.deepcopy(b.model).eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return ref.requires_grad_(False)


def _run(b, ref, seqs, sft, cfg, shared: bool):
    model = copy.deepcopy(b.model)
    rows = train_round(model, ref, seqs, sft, cfg.model_copy(update={"shared_prefix": shared}),
                       TrainPlan(temperature=0.7, pad_id=b.pad_id, seed=3))
    # the last step's gradients stay on the parameters (zeroed at each step's start, not after it)
    return rows, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rows_match(shared, plain):
    assert len(shared) == len(plain)
    for s, p in zip(shared, plain):
        assert s.keys() == p.keys()
        for k in s.keys() - {"seconds"}:
            assert (s[k] is None) == (p[k] is None), k
            if s[k] is not None:
                assert s[k] == pytest.approx(p[k], rel=RTOL, abs=ATOL), (k, s[k], p[k])


def test_shared_logprobs_equal_the_unshared_forward(tiny_backend):
    b = tiny_backend
    seqs, _ = _batch(b)
    prompts = [s.behaviour_ids or s.prompt_ids for s in seqs]
    comps = [s.completion_ids for s in seqs]
    assert prompt_groups(prompts) == [[0, 1, 2, 3], [4, 6, 7], [5], [8]]  # the LoPE row shares with nobody
    for t in (0.7, 1.0):
        lp, mask, ent = shared_completion_logprobs(b.model, prompts, comps, b.pad_id, entropy=True, temperature=t)
        lp0, mask0, ent0 = completion_logprobs(b.model, prompts, comps, b.pad_id, entropy=True, temperature=t)
        assert torch.equal(mask, mask0)
        assert torch.allclose(lp * mask, lp0 * mask, rtol=RTOL, atol=1e-5)
        assert torch.allclose(ent * mask, ent0 * mask, rtol=RTOL, atol=1e-5)


def test_one_step_has_the_unshared_loss_gradients_and_rows(tiny_backend):
    """One optimizer step over the batch (GRPO with clip, LoPE's shaped ratio, k3 KL to a perturbed reference,
    SFT), shared vs unshared from identical weights: the same stats row and the same gradient on every
    parameter; and again with micro-batches small enough to split the groups across passes."""
    b = tiny_backend
    seqs, sft = _batch(b)
    ref = _reference(b)
    for cfg in (CFG, CFG.model_copy(update={"micro_batch": 3, "micro_tokens": 200})):
        rows_s, grads_s = _run(b, ref, seqs, sft, cfg, shared=True)
        rows_u, grads_u = _run(b, ref, seqs, sft, cfg, shared=False)
        _rows_match(rows_s, rows_u)
        assert rows_s[0]["sft_loss"] > 0 and rows_s[0]["kl"] > 0
        assert grads_s.keys() == grads_u.keys() and len(grads_s) == len(list(b.model.parameters()))
        for name, g in grads_s.items():
            assert torch.allclose(g, grads_u[name], rtol=RTOL, atol=ATOL), (name, (g - grads_u[name]).abs().max())


def test_several_steps_give_the_unshared_rows(tiny_backend):
    """Three optimizer steps of 4 rows in micro-batches of 2: the step rows match the unshared run's."""
    b = tiny_backend
    seqs, sft = _batch(b)
    cfg = CFG.model_copy(update={"rows_per_step": 4, "micro_batch": 2})
    _rows_match(_run(b, _reference(b), seqs, sft, cfg, True)[0], _run(b, _reference(b), seqs, sft, cfg, False)[0])


def test_the_shared_pass_runs_each_prompt_once(tiny_backend):
    """Token positions through the decoder in the old-log-prob pass: each distinct prompt once plus the
    completions, against every row's prompt + completion unshared."""
    b = tiny_backend
    seqs, _ = _batch(b)
    prompts = [s.behaviour_ids or s.prompt_ids for s in seqs]
    comps = [s.completion_ids for s in seqs]
    seen: list[int] = []
    hook = b.model.get_decoder().embed_tokens.register_forward_hook(lambda m, i, o: seen.append(i[0].numel()))
    try:
        with torch.no_grad():
            shared_completion_logprobs(b.model, prompts, comps, b.pad_id)
            n_shared = sum(seen)
            seen.clear()
            completion_logprobs(b.model, prompts, comps, b.pad_id)
            n_plain = sum(seen)
    finally:
        hook.remove()
    groups = prompt_groups(prompts)
    widest = max(len(prompts[g[0]]) + sum(len(comps[i]) for i in g) for g in groups)
    assert n_shared == len(groups) * widest  # one packed sequence per distinct prompt
    assert n_plain == len(seqs) * max(len(p) + len(c) for p, c in zip(prompts, comps))
    assert n_shared < 0.55 * n_plain  # 300 vs 603 token positions here


def test_shared_micro_batches_bound_rows_and_tokens():
    """Every row lands in exactly one pass; a pass holds at most max_rows completions and costs at most
    max_tokens tokens, its packed sequences (a prompt and its completions) times the longest (a single longer
    row goes alone)."""
    import random

    rng = random.Random(0)
    prompts = [[g] * rng.randint(5, 300) for g in range(12) for _ in range(rng.randint(1, 8))]
    lengths = [rng.randint(1, 60) for _ in prompts]
    for max_rows, max_tokens in ((8, 1024), (3, 400), (64, 100_000), (1, 16)):
        passes = shared_micro_batches(prompts, lengths, max_rows, max_tokens)
        assert sorted(i for p in passes for i in p) == list(range(len(prompts)))
        for p in passes:
            packed: dict[tuple[int, ...], int] = {}
            for i in p:
                packed[tuple(prompts[i])] = packed.get(tuple(prompts[i]), len(prompts[i])) + lengths[i]
            cost = len(packed) * max(packed.values())
            assert len(p) <= max_rows and (cost <= max_tokens or len(p) == 1), (max_rows, max_tokens, p)
    # the groups of G = 8 with 250-token prompts and 40-token completions: one prompt per pass at the defaults
    passes = shared_micro_batches([[g] * 250 for g in range(4) for _ in range(8)], [40] * 32, 8, 1024)
    assert sorted(len({i // 8 for i in p}) for p in passes) == [1, 1, 1, 1]


def test_a_split_group_is_spread_evenly_over_its_passes():
    """A group too long for one pass (a 250-token few-shot prompt and G = 8 completions of 48 at the default 512
    tokens) is split into as many passes as before, the completions spread evenly (4 + 4, 442 tokens each, not
    5 + 3 with a 490-token pass): a pass's activation memory follows its longest sequence."""
    passes = shared_micro_batches([[7] * 250] * 8, [48] * 8, 64, 512)
    assert sorted(len(p) for p in passes) == [4, 4]
    lengths = [30, 60, 40, 50, 64, 20, 45, 55]
    passes = shared_micro_batches([[7] * 250] * 8, lengths, 64, 512)
    widths = sorted(250 + sum(lengths[i] for i in p) for p in passes)
    assert len(passes) == 2 and sorted(i for p in passes for i in p) == list(range(8))
    assert widths[-1] - widths[0] <= max(lengths) and widths[-1] <= 512, widths



def test_group_steps_keep_a_prompts_rows_in_one_step(tiny_backend, monkeypatch):
    """With group_steps, the rows of a prompt train in one optimizer step, so each training forward sees whole
    groups; without it the shuffle spreads a group's rows over the steps."""
    import tasks.core.passes as passes

    b = tiny_backend
    seqs = _batch(b)[0][:8]  # the two groups of 4
    prompts_per_pass: list[int] = []

    def recording(model, prompts, completions, pad_id, device="cpu", dtype="fp32", entropy=False, temperature=1.0):
        if entropy:  # the training pass, not the old or reference log-probs
            prompts_per_pass.append(len(prompt_groups(prompts)))
        return shared_completion_logprobs(model, prompts, completions, pad_id, device, dtype, entropy, temperature)

    monkeypatch.setattr(passes, "shared_completion_logprobs", recording)
    for group_steps in (True, False):
        prompts_per_pass.clear()
        cfg = CFG.model_copy(update={"rows_per_step": 4, "sft_weight": 0.0, "group_steps": group_steps})
        assert len(train_round(copy.deepcopy(b.model), None, seqs, [], cfg, TrainPlan(0.7, b.pad_id, seed=3))) == 2
        expected = [1, 1] if group_steps else [2, 2]  # seed 3's shuffle mixes both groups into each step
        assert prompts_per_pass == expected


@pytest.mark.parametrize("shared", [True, False])
def test_a_reference_that_is_the_starting_policy_reuses_the_old_pass(tiny_backend, shared):
    """Round 0 trains the base against itself: `reference_is_policy` takes the KL reference from the old pass
    (and, for the LoPE row, a pass under its plain prompt) and loads nothing, with the same step rows as a
    frozen copy of the starting model passed as the reference. Several steps at a large learning rate, so the
    policy moves away from its reference and the KL of the later steps is not zero."""
    b = tiny_backend
    seqs, _ = _batch(b)
    cfg = CFG.model_copy(update={"lr": 1e-2, "rows_per_step": 3, "shared_prefix": shared})
    frozen = copy.deepcopy(b.model).eval().requires_grad_(False)
    plain = train_round(copy.deepcopy(b.model), frozen, seqs, [], cfg, TrainPlan(0.7, b.pad_id, seed=3))

    def no_loading():
        raise AssertionError("the reference was loaded")

    reused = train_round(copy.deepcopy(b.model), no_loading, seqs, [], cfg,
                         TrainPlan(0.7, b.pad_id, seed=3, reference_is_policy=True))
    assert len(plain) == 3 and max(r["kl"] for r in plain[1:]) > 1e-6
    _rows_match(reused, plain)
