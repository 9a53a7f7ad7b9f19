import json

import polars as pl
import pytest

from tasks.core.pool_rules import next_pool
from tasks.core.rewards import exact_match, math_equiv, verify
from tasks.strategies.gate import check_child
from tasks.strategies.ladder import LEVELS, make_cloze, make_mcq, next_level, numeric_distractors
from tasks.strategies.numbers import number_words

PARENT = "Solve the following multiplication: 7 * 8. Give only the result as your final answer."


@pytest.mark.parametrize("child", [
    PARENT + " Hint: the result is 56.",
    PARENT + " Hint: it is fifty-six.",
    PARENT + " Hint: it is Fifty Six.",
    PARENT + r" Hint: the final line is \boxed{56}.",
    PARENT + r" Hint: $56$ is what you want.",
    PARENT + " Pick one: (A) 48 (B) 56 (C) 64.",
    PARENT + ' Consider the option "56" carefully.',
    PARENT + " Sub-goals: 7*8 = 56, then write it.",
])
def test_gate_rejects_answer_leaks_in_any_form(child):
    assert check_child(child, PARENT, "56") is not None


@pytest.mark.parametrize("child,parent,answer", [
    (r"What is 1/2 + 0? Note that \frac{1}{2} stays.", "What is 1/2 + 0?", "1/2"),
    ("Calculate -3 + 0. Hint: negative three.", "Calculate -3 + 0.", "-3"),
    ("Calculate -3 + 0. Hint: minus three.", "Calculate -3 + 0.", "-3"),
])
def test_gate_rejects_fraction_and_negative_leaks(child, parent, answer):
    assert check_child(child, parent, answer) is not None


def test_gate_accepts_honest_scaffolds_and_checks_bounds():
    assert check_child(PARENT + " Think of seven groups of eight.", PARENT, "56") is None
    assert check_child(PARENT + " Is it 156 or 5.6? Neither.", PARENT, "56") is None  # not the answer
    assert check_child("Solve 0 * 4.", "Solve 0 * 4.", "0") is None  # the parent already shows 0
    assert "too short" in check_child("56?", PARENT, "56", min_chars=8)
    assert "too long" in check_child("x" * 5000, PARENT, "56", max_chars=4000)


def test_gate_checks_multiple_choice_options():
    opts = ["48", "56", "64", "72"]
    assert check_child("Q\nOptions:\n...", "Q", "56", kind="mcq", options=opts, correct=1) is None
    assert "does not verify" in check_child("Q\nOptions:", "Q", "56", kind="mcq", options=opts, correct=0)
    assert "distractor '56.0' verifies" in check_child("Q\nOptions:", "Q", "56", kind="mcq",
                                                       options=["56.0", "56", "1", "2"], correct=1)
    assert "stem" in check_child("Q: it is 56\nOptions:", "Q", "56", kind="mcq", options=opts, correct=1)


def test_number_words():
    assert [number_words(n) for n in (0, 13, 40, 99, 100, 305, 12_345)] == [
        "zero", "thirteen", "forty", "ninety-nine", "one hundred", "three hundred five",
        "twelve thousand three hundred forty-five"]


@pytest.mark.parametrize("answer,question", [("56", "7 * 8"), ("-2", "3 - 5"), ("0", "0 * 9"), ("1234", "617 * 2")])
def test_distractors_never_verify_and_are_distinct(answer, question):
    for k in (3, 9):
        d = numeric_distractors(answer, question, k, seed=1)
        assert len(d) == k == len(set(d))
        assert not any(exact_match(x, answer) or math_equiv(x, answer) for x in d)


def test_correct_letter_is_balanced_and_mcq_rewards_the_value():
    positions = [make_mcq(f"p{i}", "Solve 7 * 8.", "56", 4)[2] for i in range(400)]
    counts = [positions.count(i) for i in range(4)]
    assert min(counts) > 70, counts
    text, options, correct = make_mcq("p1", "Solve 7 * 8.", "56", 10)
    assert len(options) == 10 and options[correct] == "56" and "(J)" in text
    meta = json.dumps({"level": "mcq10", "options": options})  # as ladder_child writes it
    letter = "ABCDEFGHIJ"[correct]
    assert verify(f"The answer is ({letter}).", "56", "file", meta=meta, verifier="exact").correct
    assert verify(r"\boxed{56}", "56", "file", meta=meta, verifier="exact").correct
    wrong = "ABCDEFGHIJ"[(correct + 1) % 10]
    assert not verify(wrong, "56", "file", meta=meta, verifier="exact").correct


def test_cloze_masks_half_to_most_digits_and_keeps_one():
    for pid in ("a", "b", "c", "d"):
        text = make_cloze(pid, "Q", "123456")
        pattern = text.rsplit(": ", 1)[1]
        masked = pattern.count("_")
        assert 3 <= masked <= 5 and len(pattern) == 6
        assert all(p == a for p, a in zip(pattern, "123456") if p != "_")
    assert make_cloze("a", "Q", "7") is None  # one digit cannot be half masked and half shown


def test_ladder_order_and_promotion_in_the_pool():
    assert LEVELS == ("mcq4", "mcq10", "cloze", "open") and next_level("mcq4") == "mcq10"
    assert next_level("open") is None
    pool = pl.DataFrame({"run_id": ["r"] * 3, "round": [1] * 3, "prompt_id": ["orig", "m4", "x"],
                         "status": ["reserve", "active", "active"], "level": [None] * 3},
                        schema_overrides={"level": pl.String})
    scores = pl.DataFrame({"prompt_id": ["m4", "x"], "bucket": ["informative", "informative"]})
    prompts = pl.DataFrame({"prompt_id": ["orig", "m4", "m10", "x"],
                            "transform": ["original", "mcq4", "mcq10", "original"]})
    refinements = pl.DataFrame({"parent_id": ["m4"], "child_id": ["m10"], "strategy": ["promote"],
                                "accepted": [True]})
    nxt = next_pool(pool, scores, prompts, 2, refinements)
    got = {r["prompt_id"]: (r["status"], r["level"]) for r in nxt.iter_rows(named=True)}
    assert got == {"orig": ("reserve", None), "m4": ("retired", "mcq4"), "m10": ("active", "mcq10"),
                   "x": ("active", None)}


# ---- the cloze rung: its own meta, its own gate, its mask share ------------------------------------------

ROOT = {"prompt_id": "root78", "text": "What is 123 + 333?", "answer": "456", "solution": None,
        "source": "file", "params": None, "root_id": "root78", "transform": "original", "meta": None}


def _rungs():
    from tasks.strategies.ladder import ladder_child

    m10, reason = ladder_child(ROOT, ROOT, "mcq10", "r", 1)
    assert reason is None
    cloze, reason = ladder_child(m10, ROOT, "cloze", "r", 2)
    return m10, cloze, reason


def test_cloze_answer_must_be_the_value_not_an_mcq10_letter():
    """The cloze rung of an mcq10 parent inherited its options, so \\boxed{F} on "The answer should look like:
    4__" scored 1.0. A cloze child's meta holds no options, and no letter verifies on it."""
    m10, cloze, reason = _rungs()
    assert reason is None
    meta = json.loads(cloze["meta"])
    assert meta == {"level": "cloze"}, meta
    assert "The answer should look like:" in cloze["text"] and "Options" not in cloze["text"]
    letter_scores = [verify(rf"\boxed{{{x}}}", "456", "file", meta=cloze["meta"], verifier="exact").reward
                     for x in "ABCDEFGHIJ"]
    assert letter_scores == [0.0] * 10
    assert verify(r"\boxed{456}", "456", "file", meta=cloze["meta"], verifier="exact").correct
    # the mcq10 parent itself still maps its correct letter to the value
    options = json.loads(m10["meta"])["options"]
    letter = "ABCDEFGHIJ"[options.index("456")]
    assert verify(rf"\boxed{{{letter}}}", "456", "file", meta=m10["meta"], verifier="exact").correct


def test_verifier_maps_letters_only_on_multiple_choice_rungs():
    """A cloze stored before the fix still carries its parent's options: the verifier reads the rung's level,
    not the presence of options, so a letter never stands for a value there (nor on the open question)."""
    options = ["450", "456", "465", "546"]
    for level, expected in (("mcq4", True), ("mcq10", True), ("cloze", False), ("open", False), (None, False)):
        meta = json.dumps({"level": level, "options": options})
        assert verify("The answer is (B).", "456", "file", meta=meta, verifier="exact").correct is expected, level


def test_cloze_children_pass_the_gate():
    """Cloze children skipped the gate and its length bounds; now they are judged like every child, and a
    pattern that hides no digit of the answer reveals it."""
    from tasks.strategies.ladder import ladder_child

    long_root = {**ROOT, "text": "What is 123 + 333? " + "Think carefully. " * 250}
    child, reason = ladder_child(long_root, long_root, "cloze", "r", 1)
    assert child is not None and reason is not None and reason.startswith("too long"), reason
    assert check_child("Q\nThe answer should look like: 456", "Q", "456", kind="cloze").startswith("reveals answer")
    assert check_child("Q\nThe answer should look like: 4__", "Q", "456", kind="cloze") is None
    assert check_child("Q\nThe answer should look like: 4_", "Q", "456", kind="cloze").startswith("bad pattern")
    assert check_child("Q\nThe answer should look like: 5__", "Q", "456", kind="cloze").startswith("bad pattern")


@pytest.mark.parametrize("n_digits", range(2, 13))
def test_cloze_masks_50_to_80_percent_of_the_digits_and_keeps_one(n_digits):
    """docs/algorithms.md §3.2: mask 50-80% of the answer's digits with '_', and keep at least one digit (6-7-digit
    answers were masked up to 86%)."""
    answer = "-" + "".join(str((7 * i + 3) % 10) for i in range(n_digits))
    shares = set()
    for pid in range(60):
        pattern = make_cloze(f"p{pid}", "Q", answer).rsplit(": ", 1)[1]
        masked = pattern.count("_")
        assert len(pattern) == len(answer) and pattern[0] == "-"
        assert 0.5 <= masked / n_digits <= 0.8 and masked < n_digits, (answer, pattern)
        assert all(p == a for p, a in zip(pattern, answer) if p != "_")
        shares.add(masked)
    lo, hi = -(-n_digits // 2), (4 * n_digits) // 5
    assert shares == set(range(lo, hi + 1)), shares  # every admissible count is drawn


# ---- a new strategy is one class: registered, routed by the refine stage, judged by the gate ---------------

def test_a_registered_strategy_is_routed_through_the_gate(store, request):
    """The smallest real strategy (the example of docs/architecture.md), registered here without touching a
    project file: refine offers it the round's too_hard originals (not the solved one) and runs the gate's checks
    on its children, so a child over refine.gate_max_chars is rejected as 'too long' and never enters prompts."""
    import datetime as dt

    import pyarrow as pa
    from conftest import land_pool, q, round_ctx

    import tasks.strategies.base
    from flows.config import RefineConfig
    from tasks.core.eps import eps_scores
    from tasks.core.ids import prompt_id
    from tasks.refine import refine
    from tasks.strategies import Parent, Proposal, RoundView, Strategy, register

    class StepByStep(Strategy):
        name = "step_by_step"
        buckets = frozenset({"too_hard"})

        def propose(self, parent: Parent, view: RoundView) -> list[Proposal]:
            text = f"{parent.row['text']}\nThink step by step."
            return [Proposal(parent.row, view.child(parent.row, text, self.name))]

    register(StepByStep)
    request.addfinalizer(lambda: tasks.strategies.base.REGISTRY.pop("step_by_step"))  # no later test sees it
    questions = {"short": ("What is 7 * 8?", "56"), "long": ("What is 6 * 9? " + "Take care. " * 5, "54"),
                 "solved": ("What is 2 * 3?", "6")}
    ids = {k: prompt_id(t, a, "file") for k, (t, a) in questions.items()}
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    store.commit("seed", {"prompts": pa.Table.from_pylist([
        {"prompt_id": ids[k], "text": t, "answer": a, "source": "file", "root_id": ids[k], "transform": "original",
         "created_at": now} for k, (t, a) in questions.items()])})
    rollouts = pl.DataFrame([{"run_id": "a", "round": 0, "policy_version": 0, "prompt_id": ids[k], "sample_idx": j,
                              "prompt_text": questions[k][0], "completion": "no", "reward": float(k == "solved"),
                              "correct": k == "solved", "n_tokens": 1, "mean_logprob": -1.0, "finish_reason": "stop"}
                             for k in questions for j in range(4)])
    store.commit("collect", {"rollouts": rollouts.to_arrow()}, run_id="a", round=0)
    land_pool(store, "a", 0, list(ids.values()))
    store.commit("score", {"prompt_scores": eps_scores(rollouts).to_arrow()}, run_id="a", round=0)

    cfg = RefineConfig(gate_max_chars=60).model_copy(update={"strategies": ["step_by_step"]})
    out = refine(round_ctx(store, "a"), store, cfg, None)
    got = {r["parent_id"]: r for r in q(store, "SELECT parent_id, strategy, accepted, reason FROM refinements")}
    assert set(got) == {ids["short"], ids["long"]} and {r["strategy"] for r in got.values()} == {"step_by_step"}
    assert got[ids["short"]]["accepted"] and got[ids["short"]]["reason"] is None
    assert not got[ids["long"]]["accepted"] and got[ids["long"]]["reason"].startswith("too long")
    made = q(store, "SELECT text, parent_id FROM prompts WHERE transform = 'step_by_step'")
    assert made == [{"text": "What is 7 * 8?\nThink step by step.", "parent_id": ids["short"]}]
    assert out["children"] == 1 and out["rejections"] == {"too long": 1}


def test_every_configurable_strategy_is_registered_and_routed_in_choice_order():
    from typing import get_args

    from tasks.refine import StrategyName, routing_order
    from tasks.strategies import REGISTRY, strategy

    assert set(get_args(StrategyName)) <= set(REGISTRY)
    assert [strategy(n).name for n in get_args(StrategyName)] == list(get_args(StrategyName))
    assert routing_order(["harden", "step_by_step", "ladder"]) == ["ladder", "harden", "step_by_step"]
    with pytest.raises(ValueError, match=r"^no refinement strategy 'nope' is registered under tasks/strategies/"):
        strategy("nope")
