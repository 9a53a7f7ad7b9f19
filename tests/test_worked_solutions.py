"""Worked reference solutions for reasoning-gym prompts (tasks/core/worked_solutions.py, issue 50 item 3): every
one written verifies under the real verifier and states only true equalities, a wrong operand changes it, rg_rows
attaches them behind `pool.rg_solutions` (off for runs stored before it), and on a 2-round scripted run they
reach hint_prefix children and reference-started shaping."""

import ast
import json
import operator
import re
from fractions import Fraction

import pytest
from conftest import q, run_cli

from flows.config import RunConfig, load_config
from models.scripted import arithmetic_problem
from storage.store import Store
from tasks.core.rewards import RewardConfig
from tasks.core.sources import rg_rows
from tasks.core.verdicts import verify_row
from tasks.core.worked_solutions import arithmetic_solution, worked_solution
from tasks.ingest import ingest_source
from tasks.pool import DEFAULT_SOURCES

# the default pool's entries, the wider settings soften/harden move between, and the tasks' own defaults
CASES = [(s.source[3:], dict(s.params)) for s in DEFAULT_SOURCES] + [
    ("products", {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 3}),
    ("products", {"min_digits": 2, "max_digits": 2, "max_terms": 2}),
    ("chain_sum", {}), ("basic_arithmetic", {}), ("basic_arithmetic", {"whitespace": "random"}),
    ("gcd", {}), ("lcm", {}),
]
N = 300  # items per case


def _rows(task: str, params: dict, n: int = N, seed: int = 7) -> list[dict]:
    return [r.__dict__ for r in rg_rows(task, n, seed, params)]


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _value(node: ast.AST) -> Fraction:
    """An independent evaluator (integers, + - * /, unary minus): the test does not trust the module's."""
    if isinstance(node, ast.Expression):
        return _value(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    raise ValueError(ast.dump(node))


def _equalities(solution: str) -> list[list[Fraction]]:
    """The arithmetic sides of every `a = b = c` chain in the solution's text (boxed answer excluded)."""
    body = solution.rsplit("\\boxed{", 1)[0]
    chains = []
    for clause in re.split(r"\.\s+|, so |, since |: ", body):
        sides = []
        for side in clause.strip().rstrip(".").split(" = "):
            try:
                sides.append(_value(ast.parse(side.replace("×", "*"), mode="eval")))
            except (SyntaxError, ValueError):
                continue  # "gcd(4, 6)", "So gcd(4, 6)": a name, not arithmetic
        if len(sides) >= 2:
            chains.append(sides)
    return chains


@pytest.mark.parametrize(("task", "params"), CASES, ids=[f"{t}-{i}" for i, (t, _) in enumerate(CASES)])
def test_every_written_solution_verifies_and_states_only_true_equalities(task, params):
    cfg = RewardConfig()
    rows = _rows(task, params)
    written = [r for r in rows if r["solution"] is not None]
    for r in written:
        v = verify_row(r, r["solution"], cfg)
        assert (v.reward, v.correct) == (1.0, True), (r["text"], r["solution"])
        assert v.extracted == r["answer"] and r["solution"].endswith(f"\\boxed{{{r['answer']}}}")
        chains = _equalities(r["solution"])
        assert chains, r["solution"]
        assert all(len(set(c)) == 1 for c in chains), (r["solution"], chains)
    # every item of these tasks gets one, except an inexact (floored) division in the full basic_arithmetic
    assert len(written) == len(rows) if task != "basic_arithmetic" or params.get("operators") else \
        len(written) >= 0.95 * len(rows)


def test_a_wrong_operand_changes_the_solution_and_the_verifier_catches_it():
    cfg = RewardConfig()
    for task, params in [("products", {"min_digits": 2, "max_digits": 2}), ("chain_sum", {"max_terms": 3}),
                         ("basic_arithmetic", dict(DEFAULT_SOURCES[1].params))]:
        for r in _rows(task, params, n=100, seed=3):
            meta = json.loads(r["meta"])
            first = re.search(r"\d+", meta["expression"])
            bent = meta["expression"][:first.start()] + str(int(first.group()) + 1) + meta["expression"][first.end():]
            # written against the row's answer, the bent expression gets no solution (never a wrong one) ...
            assert worked_solution(task, r["text"], r["answer"], {**meta, "expression": bent}) is None
            # ... and its own correct solution fails the real verifier on the original row
            _, value = arithmetic_problem(f"{bent} =")
            other = arithmetic_solution(bent, value)
            assert other is not None and value != r["answer"]
            assert verify_row(r, other, cfg).correct is False


def test_tasks_without_a_writer_or_an_exact_step_get_none():
    assert worked_solution("leg_counting", "How many legs?", "4", {"expression": "2 + 2"}) is None
    assert worked_solution("products", "q", "56", None) is None  # no metadata, nothing to work from
    assert worked_solution("products", "q", "56", "not json") is None
    assert arithmetic_solution("7 / 2", "3") is None  # reasoning-gym floors it; a worked step would not
    assert arithmetic_solution("7 * (8", "56") is None and arithmetic_solution("__import__('os')", "0") is None
    assert worked_solution("gcd", "q", "2", {"numbers": [4, 6, 8]}) is None  # two numbers only
    assert arithmetic_solution("23 * 45", "1035") == "23 × 45 = 23 × 40 + 23 × 5 = 920 + 115 = 1035. \\boxed{1035}"


def test_rg_rows_attach_solutions_behind_the_pool_switch_and_old_runs_resume_without_it():
    with_, without = rg_rows("products", 5, 0, {"max_digits": 1}), rg_rows("products", 5, 0, {"max_digits": 1}, False)
    assert all(r.solution for r in with_) and all(r.solution is None for r in without)
    assert [r.prompt_id for r in with_] == [r.prompt_id for r in without]  # the solution is not part of the id
    assert RunConfig().pool.rg_solutions is True
    stored = RunConfig().model_dump(mode="json")
    del stored["pool"]["rg_solutions"]  # a run stored before the field existed landed none
    assert load_config(stored=stored, run_id="old").pool.rg_solutions is False
    assert load_config(stored={**stored, "pool": {**stored["pool"], "rg_solutions": True}},
                       run_id="new").pool.rg_solutions is True


def test_ingest_lands_rg_solutions_and_a_jsonl_solution_field(store, tmp_path):
    ingest_source(store, "rg:chain_sum", size=6, seed=2, params={"max_terms": 3})
    f = tmp_path / "mine.jsonl"
    f.write_text(json.dumps({"question": "What is 6 * 7?", "answer": 42, "solution": "6 × 7 = 42. \\boxed{42}"})
                 + "\n" + json.dumps({"question": "What is 2 + 2?", "answer": 4}) + "\n")
    ingest_source(store, str(f))
    rows = q(store, "SELECT text, answer, source, meta, solution FROM prompts ORDER BY source, text")
    assert [(r["source"], r["solution"]) for r in rows if r["source"] == "mine.jsonl"] == [
        ("mine.jsonl", None), ("mine.jsonl", "6 × 7 = 42. \\boxed{42}")]
    rg = [r for r in rows if r["source"] == "rg:chain_sum"]
    assert len(rg) == 6 and all(verify_row(r, r["solution"], RewardConfig()).correct for r in rg)


# ---- end to end: a 2-round scripted run over an rg pool ------------------------------------------------------
def _sets() -> list[str]:
    # G = 2 collects whole groups (screening is off when its samples would fill the group): an all-fail
    # group is then scored too_hard, the bucket hint_prefix refines, and its prompt is unsolved for shaping
    return ["model.policy=tiny-random", "model.backend=scripted", "model.dtype=fp32",
            "rollout.group_size=2", "rollout.max_new_tokens=40", "select.embedder=hashing", "select.batch_size=24",
            'refine.strategies=["hint_prefix"]', "shape.enabled=true", "shape.teacher_traces=false", "shape.steps=4",
            "shape.max_traces=4", "shape.max_new_tokens=32", "train.lr=1e-3", "eval.n_samples=2", "eval.k=1",
            "governor.enabled=false",
            'pool.sources=[{"source": "rg:products", "size": 12, "params": {"max_digits": 1}}, '
            '{"source": "rg:chain_sum", "size": 12, "params": {"min_terms": 2, "max_terms": 2, "max_digits": 1}}, '
            '{"source": "rg:products", "size": 6, "params": {"min_digits": 2, "max_digits": 2}}]']


def test_a_scripted_run_over_an_rg_pool_makes_hint_children_and_reference_traces(prefect_api, tmp_path):
    store = Store(tmp_path / "store")
    code, _, err = run_cli("run", "--run-id", "rgsol", "--rounds", "2", "--store", store.root,
                           *[a for s in _sets() for a in ("--set", s)])
    assert code == 0, err
    originals = q(store, "SELECT count(*) AS n, count(solution) AS s FROM prompts WHERE transform = 'original'")[0]
    assert originals["n"] == originals["s"] > 20
    hints = q(store, """SELECT c.text, p.solution, p.answer, p.text AS question, c.meta
                        FROM refinements f JOIN prompts c ON c.prompt_id = f.child_id
                        JOIN prompts p ON p.prompt_id = f.parent_id
                        WHERE f.run_id = 'rgsol' AND f.strategy = 'hint_prefix' AND f.accepted
                          AND p.source LIKE 'rg:%'""")
    assert hints, q(store, "SELECT strategy, accepted, reason FROM refinements")
    for h in hints:
        shown = h["text"].removeprefix(h["question"] + "\nA solution starts like this: ").removesuffix(" ...")
        assert shown != h["text"] and h["solution"].startswith(shown), h
    traces = q(store, """SELECT t.origin, t.start_text, p.solution, p.source FROM shaped_traces t
                         JOIN (SELECT DISTINCT prompt_id, solution, source FROM prompts) p USING (prompt_id)
                         WHERE t.run_id = 'rgsol'""")
    assert traces and all(t["origin"] == "reference" and t["source"].startswith("rg:")
                          and t["start_text"] == t["solution"] for t in traces), traces
