"""The curriculum flow on the scripted policy (models/scripted.py), which answers correctly at a known rate per
prompt, so every path that needs a correct answer is taken through the real pipeline; each is asserted
through SQL on the store. One 3-round run is shared by the flow assertions (module fixture).

Plus the backend's own contract: the real protocol, real log-probs, determinism and its solve rates."""

import json
import math

import pytest
import torch
from conftest import q

from flows.config import load_config
from models.backend import Backend, Sampling
from models.scripted import (
    arithmetic_problem,
    base_rate,
    checkpoint_version,
    read_prompt,
    script,
    solve_rate,
)
from storage.query import sql
from storage.store import Store
from tasks.core.rewards import verify
from tasks.core.seeds import row_seeds

INSTRUCTION = "Put your final answer within \\boxed{}."
RUN = "scripted"


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
            direct = b.score_ids([b.encode([p])[0]], [c.token_ids], temperature=0.7)[0]  # the sampling T's
            assert len(c.logprobs) == c.n_tokens and torch.allclose(torch.tensor(c.logprobs), torch.tensor(direct))
            assert max(c.logprobs) < 0
    short = b.generate(prompts[:1], 2, Sampling(temperature=0.7, max_new_tokens=5, seed=3))[0]
    assert all(c.finish_reason == "length" and c.n_tokens == 5 for c in short)
    assert [c.token_ids for c in short] == [c.token_ids[:5] for c in out[0][:2]]
    from tasks.selectors.embed import embed_policy  # the `policy` embedder reads the wrapped model's hidden states

    vecs = embed_policy(["What is 7 * 8?", "Hi"], b)
    assert vecs.shape == (2, b.model.config.hidden_size) and torch.allclose(torch.tensor(vecs).norm(dim=1),
                                                                           torch.ones(2))


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
    from tasks.core.sources import rg_rows

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
    from tasks.core.lope import lorem_prefixes

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


# ---- the curriculum flow on the scripted policy --------------------------------------------------------------
def _unsolved_source(folder) -> str:
    """Six additions the scripted policy never solves at version 0 (base rate 0), with reference solutions:
    the too_hard groups that LoPE, the format ladder, hint prefixes and MCMC shaping start from."""
    rows = [{"question": f"What is {a} + {b}?", "answer": str(a + b),
             "solution": f"{a} + {b} = {a + b}, so the answer is \\boxed{{{a + b}}}."}
            for a in range(1, 20) for b in range(1, 20) if base_rate(f"{a} + {b}") == 0][:6]
    path = folder / "unsolved.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def scripted_sets(source: str) -> list[str]:
    return ["model.policy=tiny-random", "model.backend=scripted", "model.dtype=fp32",
            "rollout.group_size=4", "rollout.max_new_tokens=40", "rollout.include_reserve=true",
            "rollout.fewshot_p0=1.0", "rollout.lope_prefixes=6", "rollout.lope_max_groups=1",
            "select.embedder=hashing", "select.batch_size=16",
            'refine.strategies=["ladder", "hint_prefix", "harden"]', "refine.teacher_distractors=false",
            "shape.enabled=true", "shape.teacher_traces=false", "shape.steps=6", "shape.max_traces=4",
            "shape.max_new_tokens=32", "train.lr=1e-3", "eval.n_samples=4", "eval.k=2", "eval.decoding=sampled",
            "rollout.screen_samples=0",  # every selected prompt scored at G: the too_hard paths need them
            'pool.sources=[{"source": "rg:products", "size": 8, "params": {"max_digits": 1}}, '
            '{"source": "rg:chain_sum", "size": 8, "params": {"min_terms": 2, "max_terms": 2, "max_digits": 1}}, '
            f'{{"source": "{source}"}}]']


@pytest.fixture(scope="module")
def run(prefect_api, tmp_path_factory):
    """One 3-round curriculum run on the scripted policy; returns (store, flow result)."""
    from flows.curriculum import curriculum

    folder = tmp_path_factory.mktemp("scripted")
    store = Store(folder / "store")
    out = curriculum(load_config(sets=scripted_sets(_unsolved_source(folder)), run_id=RUN, store=store.root,
                                 rounds=3))
    return store, out



# the reward of the policy's own sample: a LoPE replacement stands for the failure it displaced
OWN_REWARD = """CASE WHEN json_extract(r.augmentation, '$.lorem_perturb.replaced')::BOOLEAN
                     THEN json_extract(r.augmentation, '$.lorem_perturb.own_reward')::DOUBLE ELSE r.reward END"""


def test_every_bucket_occurs_and_follows_from_its_group(run):
    """Each bucket follows from the policy's own samples of its group (LoPE replacements train only)."""
    store, _ = run
    groups = q(store, f"""SELECT s.round, s.prompt_id, s.bucket, s.eps, s.n, list({OWN_REWARD}) AS rewards
                          FROM prompt_scores s JOIN rollouts r USING (run_id, round, policy_version, prompt_id)
                          WHERE s.run_id = '{RUN}' GROUP BY ALL""")
    buckets = {g["bucket"] for g in groups}
    assert {"informative", "saturated", "too_hard"} <= buckets, buckets
    for g in groups:  # binary rewards, tau = 0: a mixed group has EPS > 0
        r = g["rewards"]
        want = "informative" if min(r) < max(r) else "saturated" if min(r) == 1 else "too_hard" if max(r) == 0 else "flat"
        assert g["bucket"] == want and (g["eps"] > 0) == (want == "informative") and g["n"] == len(r) == 4, g


def test_selection_prefers_prompts_with_higher_eps(run):
    """Rounds 1 and 2 pick 16 of their candidates, weighted by last round's EPS: the picked ones' mean EPS
    exceeds the candidates' (over the candidates scored last round)."""
    store, _ = run
    rows = q(store, f"""SELECT p.round, count(*) AS scored, count(sel.prompt_id) AS picked,
                               avg(prev.eps) FILTER (WHERE sel.prompt_id IS NOT NULL) AS eps_picked,
                               avg(prev.eps) AS eps_candidates
                        FROM pool p
                        JOIN prompt_scores prev ON prev.run_id = p.run_id AND prev.round = p.round - 1
                                               AND prev.prompt_id = p.prompt_id
                        LEFT JOIN selections sel ON sel.run_id = p.run_id AND sel.round = p.round
                                                AND sel.prompt_id = p.prompt_id
                        WHERE p.run_id = '{RUN}' AND p.status IN ('active', 'reserve') GROUP BY 1 ORDER BY 1""")
    assert [r["round"] for r in rows] == [1, 2]
    for r in rows:
        assert 0 < r["picked"] < r["scored"] and r["eps_picked"] > r["eps_candidates"] > 0, r


def test_ladder_rungs_are_promoted_and_the_easier_one_retired(run):
    store, _ = run
    rows = q(store, f"""WITH kinds AS (SELECT DISTINCT prompt_id, transform FROM prompts)
                        SELECT f.round, kp.transform AS rung, kc.transform AS next_rung, s.mean_reward,
                               np.status AS parent_after, nc.status AS child_after
                        FROM refinements f
                        JOIN kinds kp ON kp.prompt_id = f.parent_id JOIN kinds kc ON kc.prompt_id = f.child_id
                        JOIN prompt_scores s ON s.run_id = f.run_id AND s.round = f.round AND s.prompt_id = f.parent_id
                        JOIN pool np ON np.run_id = f.run_id AND np.round = f.round + 1 AND np.prompt_id = f.parent_id
                        JOIN pool nc ON nc.run_id = f.run_id AND nc.round = f.round + 1 AND nc.prompt_id = f.child_id
                        WHERE f.run_id = '{RUN}' AND f.strategy = 'promote' AND f.accepted""")
    ladder = [r for r in rows if r["rung"] in ("mcq4", "mcq10", "cloze")]
    assert ladder, rows
    step = {"mcq4": {"mcq10"}, "mcq10": {"cloze", "original"}, "cloze": {"original"}}
    for r in ladder:
        assert r["mean_reward"] > 0.5 and r["next_rung"] in step[r["rung"]], r
        assert (r["parent_after"], r["child_after"]) == ("retired", "active"), r


def test_reserve_prompts_that_recover_come_back(run):
    """With rollout.include_reserve, a reserve prompt picked again is collected by the newer policy; the
    informative ones are active next round, the others stay in reserve. The last round has no stored next
    pool: the pool stage's own rule (utility.next_pool) derives it from the stored rows. (Recovery is scored on
    the policy's own samples: a LoPE rescue does not bring a reserve prompt back.)"""
    import polars as pl

    from tasks.core.pool_rules import next_pool

    store, _ = run
    rows = q(store, f"""SELECT a.round, a.prompt_id, s.bucket, b.status AS after
                        FROM pool a
                        JOIN prompt_scores s ON s.run_id = a.run_id AND s.round = a.round AND s.prompt_id = a.prompt_id
                        LEFT JOIN pool b ON b.run_id = a.run_id AND b.round = a.round + 1 AND b.prompt_id = a.prompt_id
                        WHERE a.run_id = '{RUN}' AND a.status = 'reserve'""")
    last = max(r["round"] for r in rows)
    assert all(r["after"] is not None for r in rows if r["round"] < last), rows

    def frame(table: str) -> pl.DataFrame:
        return pl.from_arrow(sql(store, f"SELECT * FROM {table} WHERE run_id = '{RUN}' AND round = {last}"))

    kinds = pl.from_arrow(sql(store, "SELECT DISTINCT prompt_id, transform FROM prompts"))
    derived = dict(next_pool(frame("pool"), frame("prompt_scores"), kinds, last + 1, frame("refinements"))
                   .select("prompt_id", "status").iter_rows())
    rows = [dict(r, after=r["after"] or derived[r["prompt_id"]]) for r in rows]
    assert any(r["after"] == "active" for r in rows), rows
    assert all(r["after"] == ("active" if r["bucket"] == "informative" else "reserve") for r in rows), rows


def test_lope_rescues_all_fail_groups_with_correct_resamples(run):
    """Correct resamples replace failures for training, while the group is scored on the policy's own samples:
    it stays too_hard with EPS 0 (before issue 12 it read informative), and the score stage counts it as
    rescued, apart from the informative groups."""
    store, out = run
    rows = q(store, f"""SELECT r.round, r.prompt_id, r.correct, r.prompt_text, r.augmentation, s.bucket, s.eps,
                               s.mean_reward
                        FROM rollouts r JOIN prompt_scores s USING (run_id, round, policy_version, prompt_id)
                        WHERE r.run_id = '{RUN}' AND r.augmentation LIKE '%lorem_perturb%'""")
    replaced = [r for r in rows if json.loads(r["augmentation"])["lorem_perturb"].get("replaced")]
    assert replaced
    for r in replaced:
        lope = json.loads(r["augmentation"])["lorem_perturb"]
        assert r["correct"] and lope["own_reward"] == 0.0
        assert (r["bucket"], r["eps"], r["mean_reward"]) == ("too_hard", 0.0, 0.0)
        assert lope["behaviour_prompt"] != r["prompt_text"] and read_prompt(lope["behaviour_prompt"]).lorem
    for key in {(r["round"], r["prompt_id"]) for r in replaced}:  # a rescued group keeps a failure
        assert any(not r["correct"] for r in rows if (r["round"], r["prompt_id"]) == key)
    rescued = {}
    for r in replaced:
        rescued.setdefault(r["round"], set()).add(r["prompt_id"])
    scored = {s["round"]: s["rescued"] for s in out["stages"] if s["stage"] == "score"}
    assert scored == {rd: {"groups": len(rescued.get(rd, ())), **({"too_hard": len(rescued[rd])} if rd in rescued
                                                                   else {})} for rd in range(3)}
    import contextlib
    import io

    from flows.cli import print_summary

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_summary(out)  # what `refinery run` prints: per round, rescued groups apart from informative ones
    lines = [x for x in printed.getvalue().splitlines() if "rescued by LoPE" in x]
    stages = {s["round"]: s for s in out["stages"] if s["stage"] == "score"}
    assert [x.split(":")[0] for x in lines] == ["round 0", "round 1", "round 2"], lines
    for rd, x in enumerate(lines):
        n = len(rescued.get(rd, ()))
        assert f"{stages[rd]['buckets'].get('informative', 0)} of {stages[rd]['prompts']} groups informative; " \
               f"{n} rescued by LoPE" in x and (f"own samples: too_hard {n})" in x if n else x.endswith("samples)")), x


def test_fewshot_context_comes_from_solved_siblings(run):
    """Demonstrations are solved prompts of the same source from earlier rounds, never of the prompt's own
    lineage (its rungs and hints share its answer), although this run offers such solved kin."""
    store, _ = run
    rows = q(store, f"""SELECT r.round, r.prompt_id, p.source, p.root_id, r.correct, r.prompt_text, r.augmentation
                        FROM rollouts r JOIN (SELECT DISTINCT prompt_id, source, root_id FROM prompts) p
                        USING (prompt_id)
                        WHERE r.run_id = '{RUN}' AND r.augmentation LIKE '%fewshot_context%'""")
    assert rows and any(r["correct"] for r in rows)
    solved = q(store, f"""SELECT DISTINCT r.round, r.prompt_id, p.source, p.root_id, p.text FROM rollouts r
                          JOIN (SELECT DISTINCT prompt_id, source, root_id, text FROM prompts) p USING (prompt_id)
                          WHERE r.run_id = '{RUN}' AND r.correct AND r.augmentation IS NULL""")
    for r in rows:
        demos = json.loads(r["augmentation"])["fewshot_context"]
        assert demos and r["prompt_id"] not in demos
        for d in demos:
            earlier = [s for s in solved if s["prompt_id"] == d and s["round"] < r["round"]]
            assert earlier and earlier[0]["source"] == r["source"] and earlier[0]["text"] in r["prompt_text"]
            assert earlier[0]["root_id"] != r["root_id"], (r["prompt_id"], d)  # never its own lineage
        assert read_prompt(r["prompt_text"]).demonstrations == len(demos)
    kin = [r for r in rows if any(s["root_id"] == r["root_id"] and s["prompt_id"] != r["prompt_id"]
                                  and s["round"] < r["round"] for s in solved)]
    assert kin  # the rule was exercised: a solved rung or hint of the same root was there to be (wrongly) shown


def test_grpo_trains_on_the_mixed_groups(run):
    store, out = run
    groups = q(store, f"""SELECT round, count(*) AS n, count(*) FILTER (WHERE spread > 0) AS mixed
                          FROM (SELECT round, prompt_id, max(reward) - min(reward) AS spread FROM rollouts
                                WHERE run_id = '{RUN}' GROUP BY ALL) GROUP BY 1 ORDER BY 1""")
    trained = {s["round"]: s for s in out["stages"] if s["stage"] == "train"}
    for g in groups:
        assert 0 < g["mixed"] < g["n"]
        t = trained[g["round"]]
        assert (t["groups"], t["zero_variance_groups"]) == (g["mixed"], g["n"] - g["mixed"])
        # fp32 scripted sampling reports the model's own scores: every row's old log-probs are its sampler's
        assert t["sampler_logprobs"] == t["sequences"] > 0
    steps = q(store, f"SELECT round, pg_loss, entropy, grad_norm FROM train_steps WHERE run_id = '{RUN}' ORDER BY 1")
    assert [s["round"] for s in steps] == [0, 1, 2]
    assert all(s["pg_loss"] != 0 and s["entropy"] is not None and s["grad_norm"] > 0 for s in steps)


def test_each_round_samples_the_checkpoint_the_last_one_trained(run):
    """Round 1's rollouts were scored by checkpoint v1 (not the base model), at the sampling temperature
    (rollout.temperature 0.7, as generate reports them), and v1's weights moved."""
    from safetensors.torch import load_file

    from models.hf.backend import TransformersBackend

    store, _ = run
    recorded = {r["policy_version"]: r["path"] for r in q(store, f"SELECT policy_version, path FROM checkpoints "
                                                                 f"WHERE run_id = '{RUN}'")}
    assert recorded[1] == "_checkpoints/run_id=scripted/v1"  # relative to the store: it can move
    assert recorded[0] == "tiny-random"  # the built-in base by name, not this machine's model cache
    from models.registry import resolve
    from storage.checkpoints import checkpoint_versions

    paths = {v: resolve(p) for v, p in checkpoint_versions(store, RUN).select("policy_version", "path").iter_rows()}
    assert sorted(paths) == [0, 1, 2, 3]
    w0, w1 = (load_file(f"{paths[v]}/model.safetensors") for v in (0, 1))
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)
    row = q(store, f"""SELECT prompt_text, completion, mean_logprob FROM rollouts WHERE run_id = '{RUN}'
                       AND round = 1 AND policy_version = 1 AND augmentation IS NULL AND finish_reason = 'stop'
                       ORDER BY prompt_id, sample_idx LIMIT 1""")[0]
    def mean_lp(path):
        b = TransformersBackend(path, dtype="fp32")
        lp = b.score_ids(b.encode([row["prompt_text"]]), b.encode([row["completion"]]), temperature=0.7)[0]
        return sum(lp) / len(lp)

    assert mean_lp(paths[1]) == pytest.approx(row["mean_logprob"], abs=1e-4)
    assert abs(mean_lp(paths[0]) - row["mean_logprob"]) > 1e-3


def test_mcmc_accepts_moves_that_the_verifier_keeps(run):
    store, _ = run
    rows = q(store, f"""SELECT t.*, p.answer, p.source, p.text AS question, p.meta, p.solution
                        FROM shaped_traces t JOIN (SELECT DISTINCT prompt_id, answer, source, text, meta, solution
                                                   FROM prompts) p USING (prompt_id)
                        WHERE t.run_id = '{RUN}'""")
    moved = [r for r in rows if r["correct"] and r["accept_rate"] > 0]
    assert moved, rows
    for r in moved:
        assert r["origin"] == "reference" and r["start_text"] == r["solution"] and r["tokens_changed"] > 0
        assert verify(r["text"], r["answer"], r["source"], r["question"], r["meta"]).correct


def test_heldout_pass_at_1_is_positive_and_recomputes(run, scripted):
    """Every evaluation solves something; version 0's pass@1 equals the share of correct samples that the
    same backend and the verifier give on the held-out prompts."""
    store, _ = run
    evals = q(store, f"SELECT policy_version, pass_at_1, pass_at_k FROM evals WHERE run_id = '{RUN}' ORDER BY 1")
    assert [e["policy_version"] for e in evals] == [0, 1, 2, 3]
    assert all(0 < e["pass_at_1"] <= e["pass_at_k"] for e in evals)
    held = q(store, f"""SELECT p.prompt_id, p.text, p.answer, p.source, p.meta FROM pool h
                        JOIN (SELECT DISTINCT prompt_id, text, answer, source, meta FROM prompts) p USING (prompt_id)
                        WHERE h.run_id = '{RUN}' AND h.round = 0 AND h.status = 'heldout' ORDER BY prompt_id""")
    out = scripted.generate([_ask(scripted, h["text"]) for h in held], 4, Sampling(0.7, 1.0, 40, 0),
                            row_seeds=row_seeds(0, [h["prompt_id"] for h in held]))  # keyed, as evaluate draws
    shares = [sum(verify(c.text, h["answer"], h["source"], h["text"], h["meta"]).correct for c in g) / 4
              for h, g in zip(held, out)]
    assert evals[0]["pass_at_1"] == pytest.approx(sum(shares) / len(shares))


def test_the_budget_ledger_counts_every_generating_stage_per_round(run):
    """generated_tokens: collect's rollouts and LoPE resamples, shape's MCMC proposals (one per movable trace
    and step, at most), evaluate's samples; summed per round without evaluation, the training budget."""
    store, out = run
    rows = q(store, f"SELECT round, stage, purpose, calls, completions, tokens FROM generated_tokens "
                    f"WHERE run_id = '{RUN}'")
    assert {(r["stage"], r["purpose"]) for r in rows} <= {("collect", "rollout"), ("collect", "lope"),
                                                         ("refine", "teacher"), ("shape", "teacher"),
                                                         ("shape", "mcmc"), ("evaluate", "eval")}
    for rnd in range(3):
        mine = {(r["stage"], r["purpose"]): r for r in rows if r["round"] == rnd}
        n = q(store, f"SELECT count(*) AS n, sum(n_tokens) AS t FROM rollouts WHERE run_id = '{RUN}' "
                     f"AND round = {rnd}")[0]
        assert mine["collect", "rollout"]["completions"] == n["n"]
        assert mine["evaluate", "eval"]["tokens"] == q(store, f"SELECT sum(n_tokens) AS t FROM eval_results "
                                                             f"WHERE run_id = '{RUN}' AND round = {rnd}")[0]["t"]
        traces = q(store, f"SELECT count(*) AS n, max(steps) AS s FROM shaped_traces WHERE run_id = '{RUN}' "
                          f"AND round = {rnd}")[0]
        if traces["n"]:
            assert 0 < mine["shape", "mcmc"]["completions"] <= traces["n"] * traces["s"]
            assert mine["shape", "mcmc"]["calls"] <= traces["s"]
    budget = q(store, f"""SELECT round, sum(tokens) OVER (ORDER BY round) AS cumulative FROM (
                            SELECT round, sum(tokens) AS tokens FROM generated_tokens
                            WHERE run_id = '{RUN}' AND purpose <> 'eval' GROUP BY round) ORDER BY round""")
    assert [b["round"] for b in budget] == [0, 1, 2]
    assert budget[0]["cumulative"] < budget[1]["cumulative"] < budget[2]["cumulative"]
