"""MCMC shaping: the acceptance rule against an independent computation of the MH formula, reversibility
(a move whose old suffix the length-limited proposal could not generate back is rejected, and so is a
proposal the length limit cut off), C is never left, the greedy variant never lowers the mean log-prob, and
batched == one at a time.

The tiny random model practically never samples end-of-sequence, so every proposal it makes is cut by the
length limit. Where a move has to be able to succeed, the scripted policy proposes instead: complete,
model-like suffixes (scripted text) with the tiny model's real token log-probs."""

import math
import random

import pytest
from conftest import round_ctx

from models.backend import Sampling
from tasks.core.mcmc import Trace, shape_traces, tokens_changed

QUESTION = "What is 2 + 3?"
LONG = ("We add the two numbers. Two plus three: 2 + 3 = 5. Checking: 5 - 3 = 2, which is right. "
        "So the answer is \\boxed{5}.")  # 44 tokens + EOS: most cut points leave an old suffix above a limit of 24


def _setup(backend, n, in_c, start="2 + 3 = 5 so", ended=True):
    """n chains from the same start: its token ids, plus end-of-sequence when `ended` (a complete trace)."""
    x = backend.encode([backend.render([{"role": "user", "content": QUESTION}])])[0]
    c = backend.encode([backend.render([{"role": "user", "content": f"{QUESTION}\n\nReference solution:\n"
                                         "2 + 3 = 5.\n\nContinue this partial answer in your own words."}])])[0]
    y = backend.encode([start])[0] + ([backend.eos_ids[0]] if ended else [])
    return [Trace(f"t{k}", x, c, list(y), in_c) for k in range(n)], x, c, y


LIMIT = 24


@pytest.fixture(scope="module")
def one_step_chains(scripted):
    """120 one-step MH chains from the 45-token LONG trace with a proposal limit of 24 tokens, everything in
    C, and for each chain an independent recomputation: the same per-chain draws, the proposal regenerated
    alone, and the unconstrained MH ratio from FULL-sequence scores,
    A = [pi(y'|x) (1/|y'|) q(s|c,y<i)] / [pi(y|x) (1/|y|) q(s'|c,y<i)]."""
    b = scripted
    eos = b.eos_ids[0]
    traces, x, c, y = _setup(b, 120, lambda ids: True, start=LONG)
    shape_traces(b, traces, steps=1, variant="mh", max_new_tokens=LIMIT)
    draws = []
    for t in traces:
        rng = random.Random(t.rng_seed)
        draws.append((rng.randrange(len(y)), rng.random(), rng.getrandbits(31)))
    gens = b.generate_ids([c + y[:i] for i, _, _ in draws], 1, Sampling(1.0, 1.0, LIMIT, 0),
                          row_seeds=[sd for _, _, sd in draws])
    rows = []
    for t, (i, u, _), g in zip(traces, draws, gens):
        s_new = list(g[0].token_ids) + [eos]
        rows.append({"trace": t, "cut": i, "u": u, "s_new": s_new, "y_new": y[:i] + s_new,
                     "old_suffix": len(y) - i,
                     # the proposal ended by itself (EOS) within the limit: a complete trace it can generate
                     "complete": g[0].finish_reason == "stop" and len(s_new) <= LIMIT})
    pi = b.score_ids([x] * (len(rows) + 1), [y] + [r["y_new"] for r in rows])
    q = b.score_ids([c + y[:r["cut"]] for r in rows] * 2, [y[r["cut"]:] for r in rows] + [r["s_new"] for r in rows])
    for k, r in enumerate(rows):
        log_a = (sum(pi[k + 1]) - math.log(len(r["y_new"])) + sum(q[k])
                 - (sum(pi[0]) - math.log(len(y)) + sum(q[len(rows) + k])))
        r["a_formula"] = math.exp(min(0.0, log_a))
    return rows


def test_acceptance_matches_the_mh_formula(one_step_chains):
    """On reversible moves (old suffix within the limit, proposal complete) every decision agrees with the
    recomputed formula, and the empirical acceptance rate matches the mean of min(1, A)."""
    movable = [r for r in one_step_chains if r["old_suffix"] <= LIMIT and r["complete"]]
    assert len(movable) >= 40
    agree = sum(r["trace"].decisions[0] == (r["u"] < r["a_formula"]) for r in movable)
    assert agree >= len(movable) - 1  # float rounding may flip a decision sitting exactly on the boundary
    rate = sum(r["trace"].decisions[0] for r in movable) / len(movable)
    mean_a = sum(r["a_formula"] for r in movable) / len(movable)
    print(f"{len(movable)} reversible moves: acceptance {rate:.3f}, mean min(1, A) {mean_a:.3f}")
    assert 0.05 < mean_a < 0.95  # a case where acceptance is a real decision
    assert rate == pytest.approx(mean_a, abs=3 * math.sqrt(mean_a * (1 - mean_a) / len(movable)) + 0.01)


def test_an_irreversible_move_is_rejected_whatever_the_logprobs_say(one_step_chains):
    """A cut point that leaves an old suffix longer than the proposal limit: the proposal can never generate
    it back (kappa(y|y') = 0), so the move is rejected, although the unconstrained ratio would accept many."""
    irreversible = [r for r in one_step_chains if r["old_suffix"] > LIMIT]
    assert len(irreversible) >= 40
    would_accept = [r for r in irreversible if r["complete"] and r["u"] < r["a_formula"]]
    assert len(would_accept) >= 5  # the log-probs alone say accept
    print(f"{len(one_step_chains)} chains: {len(irreversible)} irreversible, {len(would_accept)} of them "
          "accepted by the unconstrained ratio")
    assert not any(r["trace"].decisions[0] for r in irreversible)
    assert all(r["trace"].ids == r["trace"].start_ids for r in irreversible)
    assert sum(r["trace"].rejected_irreversible for r in one_step_chains) == len(irreversible)


def test_a_chain_from_a_trace_without_eos_never_moves(scripted):
    """An incomplete start (cut, no end-of-sequence token): every old suffix lacks EOS, so no move from it
    is reversible, and the trace is not in the target's support: it is not shaped, and so never lands as
    kept. The same start with EOS (control) does move under the same log-probs."""
    cut, *_, y = _setup(scripted, 12, lambda ids: True, ended=False)
    shape_traces(scripted, cut, steps=3, variant="mh", max_new_tokens=64)
    assert all(t.accepted == 0 and t.ids == y and not t.lp for t in cut)
    assert all(t.proposed == 0 for t in cut)
    ended, *_ = _setup(scripted, 12, lambda ids: True, ended=True)
    shape_traces(scripted, ended, steps=3, variant="mh", max_new_tokens=64)
    assert sum(t.accepted for t in ended) > 0


def test_a_length_cut_proposal_is_rejected(tiny_backend, scripted):
    """The tiny model does not end a suffix within 9 tokens: with the limit at the start's length (9, so
    every move is reversible) every proposal is cut by the limit, and every move is rejected.
    With scripted proposals of 14-21 tokens + EOS and a limit of 16, the cut ones are rejected while complete
    ones can be accepted, and every trace still ends in EOS (what training appends to it is then right)."""
    eos = tiny_backend.eos_ids[0]
    traces, *_, y = _setup(tiny_backend, 10, lambda ids: True)
    shape_traces(tiny_backend, traces, steps=3, variant="mh", max_new_tokens=len(y))
    assert all(t.accepted == 0 and t.ids == y and t.proposed == 3 for t in traces)
    assert sum(t.rejected_cut for t in traces) == 30
    mixed, *_ = _setup(scripted, 16, lambda ids: True)
    shape_traces(scripted, mixed, steps=3, variant="mh", max_new_tokens=16)
    assert sum(t.rejected_cut for t in mixed) > 0 and sum(t.accepted for t in mixed) > 0
    assert all(t.ids[-1] == eos and eos not in t.ids[:-1] for t in mixed)


def test_a_trace_outside_c_is_never_accepted(scripted):
    start_ids = {}

    def only_start(ids):
        return tuple(ids) == start_ids["y"]

    traces, *_, y = _setup(scripted, 6, only_start)
    start_ids["y"] = tuple(y)
    shape_traces(scripted, traces, steps=4, variant="mh", max_new_tokens=64)
    assert all(t.accepted == 0 and t.ids == y and t.proposed == 4 for t in traces)
    # and a chain whose start is not in C is not run at all
    outside, *_ = _setup(scripted, 2, lambda ids: False)
    shape_traces(scripted, outside, steps=3, variant="mh", max_new_tokens=64)
    assert all(t.proposed == 0 and not t.lp for t in outside)


def test_greedy_never_lowers_the_mean_logprob(scripted):
    traces, x, *_ = _setup(scripted, 8, lambda ids: True, start=LONG)
    means = []
    shape_traces(scripted, traces, steps=6, variant="greedy", max_new_tokens=LIMIT,
                 on_step=lambda s: means.append([sum(t.lp) / len(t.lp) for t in traces]))
    for before, after in zip(means, means[1:]):
        assert all(a >= b - 1e-9 for a, b in zip(after, before))
    assert sum(t.accepted for t in traces) > 0
    for t in traces:  # the cached log-probs are the policy's: an independent full re-score agrees
        full = scripted.score_ids([x], [t.ids])[0]
        assert sum(full) / len(full) == pytest.approx(sum(t.lp) / len(t.lp), abs=1e-4)
        assert sum(t.lp) / len(t.lp) >= sum(t.start_lp) / len(t.start_lp)


def test_batched_and_one_at_a_time_make_the_same_decisions(scripted):
    """With a limit of 16, moves are rejected for each reason (irreversible, cut, the MH draw) and some are
    accepted: the chains are the same whether run together or alone."""
    a, *_ = _setup(scripted, 8, lambda ids: True, start=LONG)
    b, *_ = _setup(scripted, 8, lambda ids: True, start=LONG)
    shape_traces(scripted, a, steps=4, variant="mh", max_new_tokens=16, batched=True)
    shape_traces(scripted, b, steps=4, variant="mh", max_new_tokens=16, batched=False)
    assert [t.decisions for t in a] == [t.decisions for t in b]
    assert [t.ids for t in a] == [t.ids for t in b]
    assert [(t.rejected_irreversible, t.rejected_cut) for t in a] == [(t.rejected_irreversible, t.rejected_cut)
                                                                     for t in b]
    assert sum(t.accepted for t in a) > 0
    assert sum(t.rejected_irreversible for t in a) > 0 and sum(t.rejected_cut for t in a) > 0


def test_tokens_changed():
    assert tokens_changed([1, 2, 3], [1, 2, 3]) == 0
    assert tokens_changed([1, 2, 3], []) == 3


def _unsolved_round(store, rows: list[tuple[str, str, str]]) -> list[str]:
    """Land `rows` (question, answer, reference solution) as prompts and round 0 of run "cap" in which the
    policy's 4 samples of each are all wrong (rollouts and scores); the prompt ids."""
    import datetime as dt

    import pyarrow as pa

    from tasks.core.ids import prompt_id

    n, m = len(rows), 4 * len(rows)  # prompts, rollouts
    ids = [prompt_id(q, a, "test") for q, a, _ in rows]
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    store.commit("ingest", {"prompts": pa.table({
        "prompt_id": ids, "text": [q for q, _, _ in rows], "answer": [a for _, a, _ in rows],
        "solution": [s for *_, s in rows], "source": ["test"] * n, "root_id": ids,
        "transform": ["original"] * n, "created_at": [now] * n})})
    # unsolved this round: every one of the policy's 4 samples wrong (both in the rollouts and their scores)
    store.commit("rollout", {"rollouts": pa.table({
        "run_id": ["cap"] * m, "round": [0] * m, "policy_version": [0] * m, "prompt_id": [p for p in ids for _ in range(4)],
        "sample_idx": [j for _ in ids for j in range(4)], "prompt_text": ["q"] * m, "completion": ["\\boxed{0}"] * m,
        "reward": [0.0] * m, "correct": [False] * m, "n_tokens": [5] * m, "finish_reason": ["stop"] * m})},
        run_id="cap", round=0)
    store.commit("score", {"prompt_scores": pa.table({
        "run_id": ["cap"] * n, "round": [0] * n, "policy_version": [0] * n, "prompt_id": ids, "n": [4] * n,
        "mean_reward": [0.0] * n, "std_reward": [0.0] * n, "eps": [0.0] * n, "bucket": ["too_hard"] * n})},
        run_id="cap", round=0)
    return ids


def test_a_reference_cut_at_the_trace_cap_is_not_shaped_nor_trained_on(store):
    """The shape stage caps a start trace at 4 x shape.max_new_tokens tokens. A reference solution longer
    than that is a cut trace: it gets no end-of-sequence token, is not shaped (even though its answer, stated
    early, still verifies), and does not land as `correct`, which is what the train stage's SFT term reads,
    so training never appends EOS to a cut trace. A short reference in the same round is shaped as usual."""
    from flows.config import load_config
    from storage.query import sql
    from tasks.shape import shape_task

    cfg = load_config(sets=["model.policy=tiny-random", "model.backend=scripted", "model.dtype=fp32",
                            "model.batch_size=16", "shape.max_new_tokens=8", "shape.steps=2",
                            "shape.teacher_traces=false"], run_id="cap", store=store.root)
    rows = [("What is 2 + 3?", "5", "2 + 3 = 5, so the answer is \\boxed{5}."),  # 15 tokens: under the cap
            ("What is 4 + 4?", "8", "The answer is \\boxed{8}. " + "Indeed 4 + 4 = 8. " * 12)]  # > 32 tokens
    ids = _unsolved_round(store, rows)
    out = shape_task.fn(round_ctx(store, "cap", 0, model=cfg.model), cfg.shape, cfg.rollout, cfg.reward, cfg.teacher)
    got = {r["prompt_id"]: r for r in sql(store, "SELECT * FROM shaped_traces WHERE run_id = 'cap'").to_pylist()}
    short, cut = got[ids[0]], got[ids[1]]
    assert short["correct"] and short["steps"] == 2 and short["start_logprob"] is not None
    assert not cut["correct"] and cut["steps"] == 0 and cut["start_logprob"] is None and cut["accept_rate"] is None
    assert [r["prompt_id"] for r in sql(store, "SELECT prompt_id FROM shaped_traces WHERE correct").to_pylist()] \
        == [ids[0]]
    assert out["traces"] == 2 and out["in_c"] == 1 and out["cut_starts"] == 1
    # with an 8-token limit every move of the short trace is rejected, and counted: its scripted suffixes
    # (14+ tokens) are cut, or its cut point leaves an old suffix longer than 8 (irreversible)
    assert out["cut_proposals"] + out["irreversible"] == 2 and short["accept_rate"] == 0


def test_shaping_without_steps_trains_on_the_worked_solution_as_written(store):
    """shape.steps = 0 (the `default_worked` arm): no proposal, no generated token; a reference that verifies
    lands as written, correct, for the SFT term, with no acceptance rate, and the stage's summary says so (it
    averaged the missing rates and crashed the first time a run tried it)."""
    from flows.config import load_config
    from storage.query import sql
    from tasks.shape import shape_task

    cfg = load_config(sets=["model.policy=tiny-random", "model.backend=scripted", "model.dtype=fp32",
                            "model.batch_size=16", "shape.steps=0", "shape.teacher_traces=false"],
                      run_id="cap", store=store.root)
    ids = _unsolved_round(store, [("What is 2 + 3?", "5", "2 + 3 = 5. \\boxed{5}"),
                                  ("What is 4 + 4?", "8", "4 + 4 = 9. \\boxed{9}")])  # a wrong one: not in C
    out = shape_task.fn(round_ctx(store, "cap", 0, model=cfg.model), cfg.shape, cfg.rollout, cfg.reward, cfg.teacher)
    got = {r["prompt_id"]: r for r in sql(store, "SELECT * FROM shaped_traces WHERE run_id = 'cap'").to_pylist()}
    good, wrong = got[ids[0]], got[ids[1]]
    assert good["correct"] and good["text"] == good["start_text"] == "2 + 3 = 5. \\boxed{5}"
    assert (good["steps"], good["accept_rate"], good["tokens_changed"]) == (0, None, 0)
    assert not wrong["correct"]
    assert (out["traces"], out["in_c"], out["accept_rate"], out["logprob_gain"]) == (2, 1, None, 0)
    assert sql(store, "SELECT count(*) AS n FROM generated_tokens WHERE stage = 'shape'").to_pylist() == [{"n": 0}]


@pytest.fixture(scope="module")
def stopping_tiny():
    """The tiny random model with a bias towards end-of-sequence on its output layer, so that its samples
    stop by themselves (the plain tiny model practically never does): proposals complete, and the
    sampler's own log-probs serve as q(s' | c, y_<i)."""
    import torch

    from models.hf.backend import TransformersBackend
    from models.registry import resolve

    b = TransformersBackend(resolve("tiny-random"), dtype="fp32", batch_size=16)
    old = b.model.get_output_embeddings()
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        head.bias[b.eos_ids[0]] = 9.0  # about 1 in 6 tokens ends the sample
    b.model.set_output_embeddings(head)
    return b


def test_a_stopped_sample_reports_its_end_token_and_log_prob(stopping_tiny):
    """The transformers backend reports the end token a sample stopped on and its log-prob: with the
    sampled tokens' log-probs they are the full-sequence score of tokens + end token."""
    b = stopping_tiny
    x = b.encode([b.render([{"role": "user", "content": QUESTION}])])[0]
    out = b.generate_ids([x, x[:-3]], 6, Sampling(1.0, 1.0, 40, 3), row_seeds=[11, 12])
    stopped = [c for g in out for c in g if c.finish_reason == "stop"]
    assert len(stopped) >= 6
    assert all(c.stop_token in b.eos_ids and c.stop_logprob is not None for c in stopped)
    assert all(c.stop_token is None for g in out for c in g if c.finish_reason == "length")
    prompts = [p for p, g in zip([x, x[:-3]], out) for c in g if c.finish_reason == "stop"]
    scored = b.score_ids(prompts, [list(c.token_ids) + [c.stop_token] for c in stopped])
    for c, s in zip(stopped, scored):
        assert list(c.logprobs) + [c.stop_logprob] == pytest.approx(s, abs=1e-4)


def test_mh_takes_q_of_the_proposal_from_the_sampler(stopping_tiny, monkeypatch):
    """Through the transformers backend, a move's q(s' | c, y_<i) is the proposal's own log-probs and the
    other terms come from the chains' kept states: nothing is scored afresh (no `score_ids` call), and every
    decision agrees with the MH formula recomputed from full-sequence scores of the chain's own draws."""
    b = stopping_tiny
    traces, x, c, y = _setup(b, 40, lambda ids: True, start=LONG)
    rows_scored = []
    score = b.score_ids

    def counting(prompts, comps, **kw):
        rows_scored.append(len(prompts))
        return score(prompts, comps, **kw)

    monkeypatch.setattr(b, "score_ids", counting)
    shape_traces(b, traces, steps=1, variant="mh", max_new_tokens=LIMIT)
    monkeypatch.undo()
    moves = []
    for t in traces:
        rng = random.Random(t.rng_seed)
        i, u, seed = rng.randrange(len(y)), rng.random(), rng.getrandbits(31)
        if len(y) - i > LIMIT:
            continue  # irreversible: rejected before generating
        g = b.generate_ids([c + y[:i]], 1, Sampling(1.0, 1.0, LIMIT, 0), row_seeds=[seed])[0][0]
        if g.finish_reason == "stop" and len(g.token_ids) < LIMIT:
            moves.append((t, i, u, list(g.token_ids) + [g.stop_token]))
    assert len(moves) >= 4
    assert rows_scored == []  # the starts and pi(s') come from open_states / extend_states
    for t, i, u, s_new in moves:
        pi_new, pi_old = b.score_ids([x, x], [y[:i] + s_new, y])
        q_old, q_new = b.score_ids([c + y[:i]] * 2, [y[i:], s_new])
        log_a = (sum(pi_new) - sum(pi_old)) + (sum(q_old) - sum(q_new)) + math.log(len(y) / (i + len(s_new)))
        assert t.decisions[0] == (math.log(u) < min(0.0, log_a))
        assert t.ids == (y[:i] + s_new if t.decisions[0] else y)
    assert any(t.decisions[0] for t, *_ in moves)


def test_kept_states_make_the_chains_of_prompts_scored_afresh(stopping_tiny, monkeypatch):
    """Several MH steps with accepted moves (so later steps start from states extended by earlier ones): the
    chains with kept states (models/hf/states.py) make the same decisions and end in the same traces as the same
    chains computing every prompt afresh (generate_and_score_ids and score_ids), and their log-probs agree."""
    b = stopping_tiny
    kept, *_ = _setup(b, 16, lambda ids: True)
    shape_traces(b, kept, steps=8, variant="mh", max_new_tokens=LIMIT)
    monkeypatch.setattr(b, "stream_from_states", None)  # the backend keeps no states: prompts scored afresh
    fresh, *_ = _setup(b, 16, lambda ids: True)
    shape_traces(b, fresh, steps=8, variant="mh", max_new_tokens=LIMIT)
    assert sum(t.accepted for t in kept) >= 4 and any(t.decisions[-1] or t.decisions[-2] for t in kept)
    assert [t.decisions for t in kept] == [t.decisions for t in fresh]
    assert [t.ids for t in kept] == [t.ids for t in fresh]
    for a, f in zip(kept, fresh):
        assert a.lp == pytest.approx(f.lp, abs=1e-4)


def test_chains_that_keep_states_do_not_wait_for_the_longest_proposal(stopping_tiny, monkeypatch):
    """Streamed chains (`stream_from_states`): a chain's next proposal joins the running batch as soon as its
    move is decided, so shaping runs fewer decode steps than lockstep would (every step as long as its longest
    proposal), and no fewer than the busiest chain's own proposals need."""
    from tasks.core import mcmc

    b = stopping_tiny
    traces, *_ = _setup(b, 8, lambda ids: True)
    drawn: dict[tuple[int, int], int] = {}  # (chain, step) -> its proposal's tokens, the end token included
    real = mcmc.proposed_suffix

    def watching(t, move, c, *args):
        drawn[traces.index(t), t.proposed - 1] = len(c.token_ids) + (c.finish_reason == "stop")
        return real(t, move, c, *args)

    monkeypatch.setattr(mcmc, "proposed_suffix", watching)
    before = b.decode_steps
    shape_traces(b, traces, steps=6, variant="mh", max_new_tokens=LIMIT)
    streamed = b.decode_steps - before
    # a proposal of L tokens takes L draws, all but its last after a decode step
    lockstep = sum(max(n for (_, s), n in drawn.items() if s == step) - 1 for step in {s for _, s in drawn})
    busiest = max(sum(n for (k, _), n in drawn.items() if k == chain) for chain in {k for k, _ in drawn})
    assert len(drawn) >= 30 and busiest - 6 <= streamed < lockstep, (streamed, lockstep, busiest)


def test_streamed_chains_report_each_step_once_and_equal_chains_shaped_alone(stopping_tiny):
    """Streamed chains call `on_step(s)` once per step, in order, when every chain has finished step s (the
    stage's progress and its mid-shaping fault point), and the chains shaped together make the same decisions
    and end in the same traces as each chain shaped alone."""
    b = stopping_tiny
    together, *_ = _setup(b, 6, lambda ids: True)
    steps_seen = []
    shape_traces(b, together, steps=5, variant="mh", max_new_tokens=LIMIT, on_step=steps_seen.append)
    assert steps_seen == [0, 1, 2, 3, 4]
    alone, *_ = _setup(b, 6, lambda ids: True)
    shape_traces(b, alone, steps=5, variant="mh", max_new_tokens=LIMIT, batched=False)
    assert sum(t.accepted for t in together) >= 2
    assert [t.decisions for t in together] == [t.decisions for t in alone]
    assert [t.ids for t in together] == [t.ids for t in alone]


def test_chains_keep_states_only_within_the_kv_budget(stopping_tiny, monkeypatch, caplog):
    """The chains' states are kept where they fit in the backend's KV budget; beyond it the prompts are
    computed afresh each step, and the log says why. The scripted policy never keeps them (its script proposes)."""
    from tasks.core.mcmc import keeps_states

    b = stopping_tiny
    traces, *_ = _setup(b, 8, lambda ids: True, start=LONG)
    assert keeps_states(b, traces, LIMIT)
    per_chain = (len(traces[0].prompt_ids) + len(traces[0].context_ids) + 2 * (len(traces[0].ids) + LIMIT))
    monkeypatch.setattr(b, "kv_cache_bytes", 8 * per_chain * b.kv_bytes_per_token - 1)
    with caplog.at_level("INFO", logger="refinery.shape"):
        assert not keeps_states(b, traces, LIMIT)
    assert "over the KV budget" in caplog.text
    assert keeps_states(b, traces[:7], LIMIT)
