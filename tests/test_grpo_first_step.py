"""The first optimizer step's rows take their old (and, in round 0, reference) log-probs from the step's own
forward (train_round's first_step_on_policy): the same step rows, gradients and weights as an old pass over
every row, and an old pass that leaves those rows out (LoPE rows, sampled under another prompt, stay in)."""

import copy

import pytest
import torch
from test_prefix import CFG, _batch, _reference, _rows_match

import tasks.core.grpo as grpo
from tasks.core.grpo import TrainPlan, train_round

RTOL, ATOL = 1e-4, 1e-6


def _train(b, ref, seqs, cfg, on_policy: bool, reference_is_policy: bool):
    model = copy.deepcopy(b.model)
    rows = train_round(model, ref, seqs, [], cfg, TrainPlan(0.7, b.pad_id, seed=3, reference_is_policy=reference_is_policy,
                                                        first_step_on_policy=on_policy))
    return rows, model


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("reference_is_policy", [True, False])
def test_one_on_policy_step_has_the_full_old_pass_gradients(tiny_backend, shared, reference_is_policy):
    """One step over the batch (LoPE and lone rows included), the KL against a perturbed reference or against
    the starting policy itself: the same stats row and gradient on every parameter."""
    b = tiny_backend
    seqs, _ = _batch(b)
    cfg = CFG.model_copy(update={"shared_prefix": shared, "sft_weight": 0.0})
    ref = None if reference_is_policy else _reference(b)
    rows_now, model_now = _train(b, ref, seqs, cfg, True, reference_is_policy)
    rows_old, model_old = _train(b, ref, seqs, cfg, False, reference_is_policy)
    assert len(rows_now) == 1 and rows_now[0]["kl"] is not None
    _rows_match(rows_now, rows_old)
    for (name, p), q in zip(model_now.named_parameters(), model_old.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=RTOL, atol=ATOL), (name, (p.grad - q.grad).abs().max())


@pytest.mark.parametrize("reference_is_policy", [True, False])
def test_later_steps_train_as_with_the_full_old_pass(tiny_backend, reference_is_policy):
    """Three steps at a large learning rate, so the later steps are off-policy and clip: the same step rows, and
    weights that agree to 1% of one step (AdamW divides by the root of its second moment, so a coordinate whose
    gradients are float noise moves by up to a share of lr either way)."""
    b = tiny_backend
    seqs, _ = _batch(b)
    cfg = CFG.model_copy(update={"lr": 1e-2, "rows_per_step": 3, "sft_weight": 0.0})
    ref = None if reference_is_policy else _reference(b)
    rows_now, model_now = _train(b, ref, seqs, cfg, True, reference_is_policy)
    rows_old, model_old = _train(b, ref, seqs, cfg, False, reference_is_policy)
    assert len(rows_now) == 3 and max(r["clip_frac"] for r in rows_now[1:]) > 0
    _rows_match(rows_now, rows_old)
    for (name, p), q in zip(model_now.named_parameters(), model_old.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-4), (name, (p - q).abs().max())


def _count_pass_rows(monkeypatch) -> list[int]:
    """The rows of each no-gradient pass train_round runs (old and reference), appended as they run."""
    counted: list[int] = []
    real = grpo.batched_logprobs

    def counting(model, prompts, comps, *args):
        counted.append(len(prompts))
        return real(model, prompts, comps, *args)

    monkeypatch.setattr(grpo, "batched_logprobs", counting)
    return counted


def test_the_old_pass_leaves_out_the_first_steps_rows(tiny_backend, monkeypatch):
    """Rows through the old pass: all 9 without; with it, all but the first step's non-LoPE rows."""
    b = tiny_backend
    seqs, _ = _batch(b)
    counted = _count_pass_rows(monkeypatch)
    cfg = CFG.model_copy(update={"rows_per_step": 5, "sft_weight": 0.0, "kl_coef": 0.0})
    for on_policy in (False, True):
        counted.clear()
        _train(b, None, seqs, cfg, on_policy, False)
        # seed 3's first step of 5 rows holds the batch's one LoPE row, which keeps its old pass: 4 rows leave
        assert counted == ([len(seqs) - 4] if on_policy else [len(seqs)])


@pytest.mark.parametrize("reference_is_policy", [True, False])
def test_the_samplers_log_probs_train_as_the_old_pass(tiny_backend, monkeypatch, reference_is_policy):
    """Rows that carry their sampler's log-probs (the transformers backend's decode loop at T = 0.7, a LoPE row
    sampled under its Lorem prompt) need no old pass, and three steps at a large learning rate train as with
    the old pass over every row: the same step rows, weights within 1% of a step. The sampler's numbers are
    the old pass's to float rounding (other kernels: packed products and a KV cache)."""
    from models.backend import Sampling
    from tasks.core.grpo import Sequence

    b = tiny_backend
    base, _ = _batch(b)
    behaviour = [s.behaviour_ids or s.prompt_ids for s in base]
    out = b.generate_ids(behaviour, 1, Sampling(0.7, 1.0, 10, 0), row_seeds=list(range(len(base))))
    given = [Sequence(s.prompt_ids, g[0].sampled_ids, s.advantage, s.behaviour_ids, g[0].sampled_logprobs)
             for s, g in zip(base, out)]
    plain = [Sequence(s.prompt_ids, s.completion_ids, s.advantage, s.behaviour_ids) for s in given]
    recomputed = grpo.batched_logprobs(b.model, behaviour, [s.completion_ids for s in given], b.pad_id, "cpu", "fp32",
                                       64, 10_000_000, 0.7, True)
    gap = max((torch.tensor(s.sampled_logprobs) - r).abs().max().item() for s, r in zip(given, recomputed))
    assert gap < 1e-4, gap
    counted = _count_pass_rows(monkeypatch)
    cfg = CFG.model_copy(update={"lr": 1e-2, "rows_per_step": 3, "sft_weight": 0.0})
    ref = None if reference_is_policy else _reference(b)
    rows_given, model_given = _train(b, ref, given, cfg, True, reference_is_policy)
    # no old pass; the reference pass: round 0's for the LoPE row under its plain prompt, else every row's
    assert counted == ([1] if reference_is_policy else [len(given)])
    rows_plain, model_plain = _train(b, ref, plain, cfg, True, reference_is_policy)
    assert max(r["clip_frac"] for r in rows_plain[1:]) > 0
    _rows_match(rows_given, rows_plain)
    for (name, p), q in zip(model_given.named_parameters(), model_plain.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-4), (name, (p - q).abs().max())
