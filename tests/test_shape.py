"""MCMC shaping on the tiny model: the acceptance rule against an independent computation of the MH
formula, C is never left, the greedy variant never lowers the mean log-prob, and batched == one at a time."""

import math

import pytest

from models.backend import Sampling
from tasks.mcmc import Trace, shape_traces, tokens_changed


def _setup(backend, n, in_c, start_len=5):
    x = backend.encode([backend.render([{"role": "user", "content": "What is 2 + 3?"}])])[0]
    c = backend.encode([backend.render([{"role": "user", "content": "What is 2 + 3?\n\nReference solution:\n"
                                         "2 + 3 = 5.\n\nContinue this partial answer in your own words."}])])[0]
    start = backend.encode(["2 + 3 = 5 so"])[0][:start_len]
    return [Trace(f"t{k}", x, c, list(start), in_c) for k in range(n)], x, c, start


def test_acceptance_matches_the_mh_formula(tiny_backend):
    """200 one-step chains from the same start, everything in C. Each decision is recomputed independently:
    the same per-chain draws, the proposal regenerated alone, and A from FULL-sequence scores,
    A = [pi(y'|x) (1/|y'|) q(s|c,y<i)] / [pi(y|x) (1/|y|) q(s'|c,y<i)]. Every decision must agree, and the
    empirical acceptance rate must match the mean of min(1, A)."""
    import random

    b = tiny_backend
    traces, x, c, y = _setup(b, 200, lambda ids: True)
    shape_traces(b, traces, steps=1, variant="mh", max_new_tokens=4)
    eos = b.eos_ids[0]
    draws = []
    for t in traces:
        rng = random.Random(t.rng_seed)
        draws.append((rng.randrange(len(y)), rng.random(), rng.getrandbits(31)))
    # the proposals again, in one call (keyed sampling: the same tokens as inside the chains)
    gens = b.generate_ids([c + y[:i] for i, _, _ in draws], 1, Sampling(1.0, 1.0, 4, 0),
                          row_seeds=[sd for _, _, sd in draws])
    news = []
    for (i, _, _), g in zip(draws, gens):
        s_new = list(g[0].token_ids) + ([eos] if g[0].finish_reason == "stop" else [])
        news.append((i, s_new, y[:i] + s_new))
    pi = b.score_ids([x] * (len(news) + 1), [y] + [yn for _, _, yn in news])
    pi_old, pi_new = sum(pi[0]), [sum(v) for v in pi[1:]]
    q = b.score_ids([c + y[:i] for i, _, _ in news] * 2, [y[i:] for i, _, _ in news] + [sn for _, sn, _ in news])
    q_old, q_new = [sum(v) for v in q[: len(news)]], [sum(v) for v in q[len(news):]]
    expected, agree = [], 0
    for k, (t, (_, u, _), (_, _, y_new)) in enumerate(zip(traces, draws, news)):
        a = math.exp(pi_new[k] - math.log(len(y_new)) + q_old[k] - (pi_old - math.log(len(y)) + q_new[k]))
        expected.append(min(1.0, a))
        agree += t.decisions[0] == (u < a)
    assert agree >= 199  # float rounding may flip a decision sitting exactly on the boundary
    rate = sum(t.decisions[0] for t in traces) / len(traces)
    mean_a = sum(expected) / len(expected)
    assert 0.05 < mean_a < 0.95  # a case where acceptance is a real decision
    assert rate == pytest.approx(mean_a, abs=3 * math.sqrt(mean_a * (1 - mean_a) / len(traces)) + 0.01)


def test_a_trace_outside_c_is_never_accepted(tiny_backend):
    start_ids = {}

    def only_start(ids):
        return tuple(ids) == start_ids["y"]

    traces, *_ , y = _setup(tiny_backend, 6, only_start)
    start_ids["y"] = tuple(y)
    shape_traces(tiny_backend, traces, steps=4, variant="mh", max_new_tokens=4)
    assert all(t.accepted == 0 and t.ids == y and t.proposed == 4 for t in traces)
    # and a chain whose start is not in C is not run at all
    outside, *_ = _setup(tiny_backend, 2, lambda ids: False)
    shape_traces(tiny_backend, outside, steps=3, variant="mh", max_new_tokens=4)
    assert all(t.proposed == 0 and not t.lp for t in outside)


def test_greedy_never_lowers_the_mean_logprob(tiny_backend):
    traces, x, *_ = _setup(tiny_backend, 8, lambda ids: True, start_len=6)
    means = []
    shape_traces(tiny_backend, traces, steps=6, variant="greedy", max_new_tokens=4,
                 on_step=lambda s: means.append([sum(t.lp) / len(t.lp) for t in traces]))
    for before, after in zip(means, means[1:]):
        assert all(a >= b - 1e-9 for a, b in zip(after, before))
    assert sum(t.accepted for t in traces) > 0
    for t in traces:  # the cached log-probs are the policy's: an independent full re-score agrees
        full = tiny_backend.score_ids([x], [t.ids])[0]
        assert sum(full) / len(full) == pytest.approx(sum(t.lp) / len(t.lp), abs=1e-4)
        assert sum(t.lp) / len(t.lp) >= sum(t.start_lp) / len(t.start_lp)


def test_batched_and_one_at_a_time_make_the_same_decisions(tiny_backend):
    a, *_ = _setup(tiny_backend, 6, lambda ids: True)
    b, *_ = _setup(tiny_backend, 6, lambda ids: True)
    shape_traces(tiny_backend, a, steps=3, variant="mh", max_new_tokens=4, batched=True)
    shape_traces(tiny_backend, b, steps=3, variant="mh", max_new_tokens=4, batched=False)
    assert [t.decisions for t in a] == [t.decisions for t in b]
    assert [t.ids for t in a] == [t.ids for t in b]


def test_tokens_changed():
    assert tokens_changed([1, 2, 3], [1, 2, 3]) == 0
    assert tokens_changed([1, 2, 3], []) == 3
