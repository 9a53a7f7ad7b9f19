"""The curriculum flow on the scripted policy (models/scripted.py), which answers correctly at a known rate per
prompt, so every path that needs a correct answer is taken through the real pipeline; each is asserted
through SQL on the store. One 3-round run is shared by the flow assertions (module fixture).

Plus the backend's own contract: the real protocol, real log-probs, determinism and its solve rates."""

import json
import math

import pytest
import torch

from models.backend import Backend, Sampling
from models.scripted import (
    ScriptedBackend,
    arithmetic_problem,
    base_rate,
    checkpoint_version,
    read_prompt,
    script,
    solve_rate,
)
from tasks.rewards import verify

INSTRUCTION = "Put your final answer within \\boxed{}."
RUN = "scripted"


@pytest.fixture(scope="module")
def scripted(tiny_backend):
    """The scripted policy on the tiny random model's weights (shared with tiny_backend, fp32)."""
    from models.registry import resolve

    return ScriptedBackend(resolve("tiny-random"), dtype="fp32", batch_size=16, model=tiny_backend.model,
                           tokenizer=tiny_backend.tokenizer)


def _ask(b, question: str) -> str:
    return b.render([{"role": "user", "content": f"{question}\n{INSTRUCTION}"}])


# ---- the backend -------------------------------------------------------------------------------------------
def test_protocol_and_real_logprobs(scripted):
    b = scripted
    assert isinstance(b, Backend)
    prompts = [_ask(b, "What is 7 * 8?"), _ask(b, "State the final answer to the following arithmetic problem: 4 - 9 =")]
    out = b.generate(prompts, 3, Sampling(temperature=0.7, max_new_tokens=64, seed=3))
    for p, group in zip(prompts, out):
        for c in group:
            assert c.finish_reason == "stop" and "\\boxed{" in c.text
            assert c.token_ids == b.encode([c.text])[0]  # the tokenizer's own encoding of the text
            direct = b.score_ids([b.encode([p])[0]], [c.token_ids])[0]
            assert len(c.logprobs) == c.n_tokens and torch.allclose(torch.tensor(c.logprobs), torch.tensor(direct))
            assert max(c.logprobs) < 0
    short = b.generate(prompts[:1], 2, Sampling(temperature=0.7, max_new_tokens=5, seed=3))[0]
    assert all(c.finish_reason == "length" and c.n_tokens == 5 for c in short)
    assert [c.token_ids for c in short] == [c.token_ids[:5] for c in out[0][:2]]


def test_deterministic_and_independent_of_the_batch(scripted):
    b = scripted
    prompts = [_ask(b, f"What is {a} + {a + 3}?") for a in range(6)]
    s = Sampling(temperature=0.7, max_new_tokens=48, seed=11)
    together = b.generate(prompts, 4, s)
    alone = [b.generate([p], 4, s)[0] for p in prompts]
    assert [[c.text for c in g] for g in together] == [[c.text for c in g] for g in alone]
    other = b.generate(prompts, 4, Sampling(temperature=0.7, max_new_tokens=48, seed=12))
    assert [[c.text for c in g] for g in together] != [[c.text for c in g] for g in other]
    # keyed rows (MCMC): row i's draw depends on its own seed only, batched or alone
    ids = b.encode(prompts)
    keyed = b.generate_ids(ids, 1, Sampling(1.0, 1.0, 48, 0), row_seeds=list(range(100, 106)))
    single = [b.generate_ids([x], 1, Sampling(1.0, 1.0, 48, 0), row_seeds=[100 + i])[0] for i, x in enumerate(ids)]
    assert [g[0].text for g in keyed] == [g[0].text for g in single]
    with pytest.raises(ValueError, match="one seed per prompt"):
        b.generate_ids(ids, 1, Sampling(), row_seeds=[1])


def test_groups_hold_the_solve_rate_and_the_verifier_agrees(scripted):
    """Sample j of n solves iff frac(u + j/n) < rate: a group holds floor or ceil of rate * n correct
    answers, and the real verifier agrees with the script on every one."""
    from tasks.sources import rg_rows

    b = scripted
    rows = rg_rows("products", 12, 0, {"max_digits": 1}) + rg_rows("chain_sum", 12, 0, {"max_terms": 2, "max_digits": 1})
    prompts = [_ask(b, r.text) for r in rows]
    out = b.generate(prompts, 8, Sampling(temperature=0.7, max_new_tokens=64, seed=5))
    rates = set()
    for r, p, group in zip(rows, prompts, out):
        rate = solve_rate(read_prompt(p))
        rates.add(rate)
        assert rate == base_rate(r.meta and json.loads(r.meta)["expression"])
        verdicts = [verify(c.text, r.answer, r.source, r.text, r.meta) for c in group]
        assert [v.correct for v in verdicts] == [script(p, j, 8, 5, 0.7)[1] for j in range(8)]
        assert sum(v.correct for v in verdicts) in (math.floor(rate * 8), math.ceil(rate * 8))
        wrong = [v.extracted for v in verdicts if not v.correct]
        assert all(w is not None and w != r.answer for w in wrong)  # a plausible slip, never the answer
    assert {0.0, 1.0} <= rates and len(rates) >= 5  # the spread that makes every bucket occur
    greedy = b.generate(prompts, 2, Sampling(temperature=0.0, max_new_tokens=64))
    assert all(g[0].text == g[1].text for g in greedy)


def test_solve_rate_rises_with_help_and_versions(scripted):
    b = scripted
    q = "What is 7 * 8?"
    expr = arithmetic_problem(q)[0]
    plain = solve_rate(read_prompt(_ask(b, q)))
    assert plain == base_rate(expr)
    mcq = f"{q}\nOptions:\n(A) 54\n(B) 56\n(C) 65\n(D) 15\nChoose the correct option and give its value as your final answer."
    fewshot = b.render([{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "\\boxed{4}"},
                        {"role": "user", "content": q}])
    from tasks.lope import lorem_prefixes

    lorem = b.render([{"role": "system", "content": lorem_prefixes(1, 0)[0]}, {"role": "user", "content": q}])
    assert solve_rate(read_prompt(_ask(b, mcq))) == min(1.0, plain + 6 / 8)
    assert solve_rate(read_prompt(fewshot)) == min(1.0, plain + 2 / 8)
    assert solve_rate(read_prompt(lorem)) == min(1.0, plain + 2 / 8)
    assert solve_rate(read_prompt(_ask(b, q)), version=2) == min(1.0, plain + 2 / 8)
    assert solve_rate(read_prompt(_ask(b, "What is the capital of France?"))) == 0.0
    # a multiple-choice answer names an option; a wrong one names a distractor
    texts = [script(_ask(b, mcq), j, 8, 0)[0] for j in range(8)]
    assert all("which is option (" in t for t in texts)
    assert {t.split("option (")[1][0] for t in texts if "\\boxed{56}" in t} <= {"B"}
    assert checkpoint_version("/s/_checkpoints/run_id=x/v3") == 3 and checkpoint_version("/c/tiny-random-llama-v2-0") == 0


def test_arithmetic_is_parsed_never_executed():
    assert arithmetic_problem("Calculate -1515 / 5 + -( -2842 * -5436 ) * -6892.") == (
        "-1515 / 5 + -( -2842 * -5436 ) * -6892", str(-1515 // 5 + -(-2842 * -5436) * -6892))
    assert arithmetic_problem("What is 2 ** 300?") is None  # no power operator
    assert arithmetic_problem("__import__('os').system('true') 1 + 1") == ("1 + 1", "2")
    assert arithmetic_problem("Divide 7 / 0 please") is None
