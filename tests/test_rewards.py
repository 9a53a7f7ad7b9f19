import json

import pytest
import reasoning_gym

from tasks.rewards import exact_match, extract_answer, last_boxed, math_equiv, verify


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
])
def test_extract_answer(text, strict, expected):
    assert extract_answer(text, strict=strict) == expected


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
