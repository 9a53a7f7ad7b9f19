import json
import logging
import os
import signal
import time

import pytest
import reasoning_gym

from tasks.core.answers import exact_match, extract_answer, last_boxed
from tasks.core.math_verify_worker import MATH_VERIFY, math_check, math_equiv
from tasks.core.rewards import verify

# sympy evaluates this power exactly: minutes of big-integer arithmetic that hold the GIL the whole time
HANGS_MATH_VERIFY = r"10^{10^{10}}"


def _rg(task, **params):
    e = reasoning_gym.create_dataset(task, size=1, seed=3, **params)[0]
    return e, json.dumps(e["metadata"])


@pytest.mark.parametrize("text,strict,expected", [
    (r"so \boxed{42}", True, "42"),
    (r"\boxed{\frac{1}{2}}", True, r"\frac{1}{2}"),
    (r"first \boxed{1} then \boxed{ -7 }", True, "-7"),
    ("<answer> 12 </answer>", True, "12"),
    (r"<answer>3</answer> but really \boxed{4}", True, "4"),
    ("The answer is 56.", True, None),
    ("The answer is 56.", False, "56"),
    ("The answer is: -3", False, "-3"),
    ("7 * 8 equals 56 and that's it", False, "56"),
    ("no digits at all", False, None),
    (r"\boxed{12", True, None),  # unbalanced: malformed output is not an answer
    ("", False, None),
    ("result −4", False, "-4"),  # unicode minus
    ("The answer is 3.5.", False, "3.5"),  # a decimal point is not the sentence's full stop
    ("The answer is 3.5. Next we check it.", False, "3.5"),
    ("The answer is 3. So 3.5 was wrong.", False, "3"),
    ("The answer is \u22125.", False, "-5"),  # U+2212 after "answer is"
    ("\\boxed{\u22125}", True, "-5"),  # and inside a box: every verifier gets an ASCII minus
    ("<answer>\u22122.5</answer>", True, "-2.5"),
])
def test_extract_answer(text, strict, expected):
    assert extract_answer(text, strict=strict) == expected


@pytest.mark.parametrize("text,expected", [
    ("The answer is 12, not 13.", "12"),            # the number after "answer is", not the phrase's last
    ("The answer is 12 apples and 3 pears", "12"),
    ("The answer is: 7 * 8 = 56.", "56"),            # a worked equation: what follows the last '='
    ("answer is 2.5e3", "2.5e3"),
    (r"The answer is $\frac{1}{2}$.", r"\frac{1}{2}"),  # LaTeX stays whole for math-verify (not the "2")
    (r"The answer is $-\frac{3}{4}$", r"-\frac{3}{4}"),
])
def test_answer_is_takes_the_stated_answer(text, expected):
    assert extract_answer(text) == expected


def test_a_stated_latex_fraction_verifies():
    assert verify(r"The answer is $\frac{1}{2}$.", "1/2", "math.jsonl").correct
    assert not verify("The answer is 12, not 13.", "13", "math.jsonl").correct


@pytest.mark.parametrize("text", [
    r"first \boxed{3}, then \boxed{4",         # cut inside the final box: 4 may be the start of 42
    r"first \boxed{3}, then \boxed{\frac{1}{2",  # cut inside a nested group
    r"first \boxed{3}, then \boxed",           # cut right after the command
    r"first \boxed{3}, then \boxed{",
    "<answer>3</answer> then <answer>4",       # a cut final answer tag is the same case
    r"<answer>3</answer> then \boxed{4",
])
@pytest.mark.parametrize("strict", [True, False])
def test_a_cut_final_box_is_no_answer(text, strict):
    """A generation cut inside its final box or answer tag has no final answer: never an earlier box, and
    outside strict mode not the cut box's digits either (a prefix of the answer it was writing)."""
    assert extract_answer(text, strict=strict) is None


def test_a_closed_box_after_a_cut_one_still_counts():
    assert extract_answer(r"\boxed{4 oops, restart: \boxed{5}", strict=True) == "5"  # the final box is whole
    assert extract_answer(r"<answer>3 then \boxed{5}", strict=True) == "5"
    assert extract_answer(r"\boxed{3} and <answer>7</answer>", strict=True) == "7"


def test_extraction_defects_change_the_verdict():
    """The three extraction defects of issue 12, at the level of the reward they produced."""
    assert verify("The answer is 3.5.", "3.5", "test", verifier="exact").correct
    assert not verify("The answer is 3.5.", "3", "test", verifier="exact").correct
    assert verify("The answer is \u22125.", "-5", "test", verifier="exact").correct
    assert not verify("The answer is \u22125.", "5", "test", verifier="exact").correct
    cut = verify(r"\boxed{56}? No, let me redo it: 7 * 8 = \boxed{5", "56", "test", verifier="exact")
    assert (cut.reward, cut.correct, cut.extracted) == (0.0, False, None)


def test_last_boxed_nested_braces():
    assert last_boxed(r"\boxed{\sqrt{\frac{a}{b}}} end") == r"\sqrt{\frac{a}{b}}"
    assert last_boxed("nothing") is None


def test_exact_match_normalises_numbers_not_words():
    assert exact_match("1,000", "1000") == exact_match("-5.0", "\u22125") == exact_match(" 7. ", "7") == 1.0
    assert exact_match("75", "-75") == exact_match("seven", "7") == exact_match(None, "7") == 0.0


def test_math_verify_equivalence_and_bounds():
    assert math_equiv(r"\frac{1}{2}", "0.5") == 1.0
    assert math_equiv("2/4", r"\frac{1}{2}") == 1.0
    assert math_equiv("3", "-3") == 0.0
    assert math_equiv(r"\frac{1}{", "0.5") == 0.0  # malformed LaTeX is wrong, not an error
    assert math_equiv("1" * 5000, "1") == 0.0  # over the size bound: not even parsed


def test_reasoning_gym_scoring_boxed_bare_negative_and_wrong():
    e, meta = _rg("basic_arithmetic", min_terms=2, max_terms=2, max_digits=2, operators=("-",))
    a = str(e["answer"])
    for text in (rf"\boxed{{{a}}}", f"The answer is {a}.", a):
        v = verify(text, a, "rg:basic_arithmetic", e["question"], meta)
        assert (v.reward, v.correct) == (1.0, True), text
    wrong = verify(str(int(a) + 1), a, "rg:basic_arithmetic", e["question"], meta)
    assert (wrong.reward, wrong.correct) == (0.0, False)
    assert verify("I refuse", a, "rg:basic_arithmetic", e["question"], meta).reward == 0.0


def test_partial_credit_is_never_correct():
    """rg scorers may give partial credit; only a full 1.0 counts as correct."""
    e, meta = _rg("chain_sum", min_terms=2, max_terms=2)
    v = verify(r"\boxed{" + str(e["answer"]) + "}", e["answer"], "rg:chain_sum", e["question"], meta,
               format_weight=0.5)
    assert v.correct and v.reward == 1.0
    half = verify(str(e["answer"]), e["answer"], "rg:chain_sum", e["question"], meta, format_weight=0.5)
    assert half.correct and half.reward == 0.5  # right answer, wrong format: reward shaped, correctness kept
    fmt_only = verify(r"\boxed{zzz}", e["answer"], "rg:chain_sum", e["question"], meta, format_weight=0.5)
    assert not fmt_only.correct and 0 < fmt_only.reward < 1


def test_strict_mode_and_unknown_verifier():
    assert not verify("42", "42", "file", strict=True).correct
    assert verify(r"\boxed{42}", "42", "file", strict=True).correct
    with pytest.raises(ValueError, match="unknown verifier 'nope'"):
        verify("1", "1", "file", verifier="nope")
    with pytest.raises(ValueError, match="needs an rg: source"):
        verify("1", "1", "file", verifier="rg")


def test_model_output_is_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    evil = f"__import__('pathlib').Path({str(marker)!r}).write_text('x')"
    for verifier in ("math", "exact"):
        verify(evil, "1", "file", verifier=verifier)
        verify(rf"\boxed{{{evil}}}", "1", "file", verifier=verifier)
    assert not marker.exists()


def test_a_hung_math_check_costs_only_itself(caplog):
    """Three checks that would run for minutes each time out, are flagged and logged, and kill their worker;
    the checks after them still score right. (With a worker thread, the first one never returned: the
    big-integer power holds the GIL, so even the timed wait could not run.)"""
    assert math_equiv(r"\frac{1}{2}", "0.5") == 1.0  # a worker is up before the clock starts
    before, starts = MATH_VERIFY.timeouts, MATH_VERIFY.starts
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="refinery.verify"):
        for _ in range(3):
            assert math_check(HANGS_MATH_VERIFY, "1", timeout=0.5) == (0.0, True)
    assert time.perf_counter() - t0 < 15  # each paid its 0.5 s budget plus a worker restart, not minutes
    assert MATH_VERIFY.timeouts - before == 3
    assert sum("math-verify timed out" in r.getMessage() for r in caplog.records) == 3
    assert math_check(r"\frac{1}{2}", "0.5") == (1.0, False)  # later checks are scored, on a fresh worker
    assert math_check("2/4", r"\frac{1}{2}") == (1.0, False)
    assert math_check("3", "-3") == (0.0, False)
    assert MATH_VERIFY.starts - starts == 3  # one replacement per timeout (the last one started on demand)


def test_verdict_flags_a_timed_out_check():
    v = verify(rf"\boxed{{{HANGS_MATH_VERIFY}}}", "1", "file", verifier="math", math_timeout=0.5)
    assert (v.reward, v.correct, v.timed_out) == (0.0, False, True)
    ok = verify(r"\boxed{\frac{1}{2}}", "0.5", "file", verifier="math")
    assert (ok.reward, ok.correct, ok.timed_out) == (1.0, True, False)


def test_a_worker_killed_from_outside_is_replaced():
    assert math_equiv(r"\frac{1}{2}", "0.5") == 1.0
    os.kill(MATH_VERIFY._proc.pid, signal.SIGKILL)
    MATH_VERIFY._proc.wait()
    assert math_check(r"\frac{3}{4}", "0.75") == (1.0, False)


def test_a_worker_that_does_not_start_closes_its_stderr_file(monkeypatch):
    """The worker's stderr goes to a temporary file; a worker that fails to start must not leak it."""
    import sys
    import tempfile

    from tasks.core.math_verify_worker import MathVerifyWorker

    opened = []
    real = tempfile.TemporaryFile

    def recording(*args, **kwargs):
        opened.append(real(*args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(tempfile, "TemporaryFile", recording)
    monkeypatch.setattr(sys, "executable", "/bin/sh")  # `sh -c "from tasks.core.math_verify_worker import ..."` fails at once
    with pytest.raises(RuntimeError, match="the math-verify worker process did not start: "):
        MathVerifyWorker()._start()
    assert len(opened) == 1 and opened[0].closed
