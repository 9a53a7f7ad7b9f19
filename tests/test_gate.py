"""The rewrite gate: a teacher's rewrite is accepted only if it keeps the parent's quantities, reads as
language and stays on topic. The noise samples are verbatim teacher_scaffold answers of the tiny random model
(the calibration set of tasks/strategies/gate.py); the topic check runs the real packaged MiniLM."""

import math

import pytest

from tasks.strategies.gate import (
    RewriteBounds,
    RewriteGate,
    language_shares,
    mean_logprobs,
    reason_category,
)
from tasks.strategies.numbers import missing_quantities, quantities
from tasks.strategies.teacher import TEACHER_TEMPLATE

PARENT = "Solve the following multiplication: 7 * 8. Give only the result as your final answer."
TINY_NOISE = [  # tiny-random as teacher, 128 new tokens, cut to their first ~25 words
    "rylic hitherto repeat judgeublic emer interviewkonlawsidden seek Conversion monoxide tract natunicode "
    "fructose Mack rural Nim begun newspaper gatheribidsorSure inappropriateellowsNs concern StewardshipChart",
    "ić commonalities Simulation pharmacistsanganquired Spark storiesKB stub coursework steril rotating snail "
    "imaginary Palestine word:// lackedanskrit altruismickTab bos distingu Genes Gos adaptingixonterbury",
    "vinyl employmentTher scrap Straitmac sustenance impartial chalk procedure define concentration reviewing "
    "lantern Gad strawberry fare especiallyprojection scorching circulatorysac Pars rough advertisements",
]
GOOD = [
    (PARENT, "Solve the following multiplication: 7 * 8. Think of seven groups of eight. Give only the result."),
    ("Calculate 2 - -1.", "Calculate 2 - -1. Remember that subtracting a negative number is the same as adding "
                          "its absolute value."),
    ("Solve the following multiplication: 15 * 43. Give only the result as your final answer.",
     "Solve 15 * 43 in two parts: first find 15 * 40, then 15 * 3, and add the two products. Give only the "
     "final result."),
    ("State the final answer to the following arithmetic problem: 4 - 1 =",
     "Work out 4 - 1: you have 4 apples and give away 1. How many apples are left? State only the final number."),
]


def _gate(**bounds):
    return RewriteGate(RewriteBounds(**bounds))


@pytest.mark.parametrize("text,expected", [
    ("Calculate 2 - -1.", ["2", "-1"]),
    ("7-3 and 7 - 3", ["7", "3", "7", "3"]),  # a minus after a number is an operator, not a sign
    ("(-4) + 1,234 * 0.5 - -0", ["-4", "1234", "0.5", "0"]),
    ("x2 and H2O hold no quantity; 56. ends a sentence", ["56"]),
])
def test_quantities_are_signed_and_normalised(text, expected):
    assert quantities(text) == expected


@pytest.mark.parametrize("child,parent,missing", [
    ("Think of seven groups of eight.", "7 * 8", []),  # words count
    ("Calculate 2 - 1.", "Calculate 2 - -1.", ["-1"]),  # a dropped sign changes the problem
    ("minus seven plus 8", "-7 + 8", []),
    ("minus seven plus 8", "7 + 8", ["7"]),  # "minus seven" is not seven
    ("Add 3 and 5.", "Add 3 + 3 + 5.", ["3"]),  # each as often as the parent has it
    ("What is 17 * 8?", "What is 7 * 8?", ["7"]),  # 7 inside 17 is no 7
    ("Is the sky blue?", "Why is the sky blue?", []),  # no numbers: nothing to keep
])
def test_missing_quantities(child, parent, missing):
    assert missing_quantities(child, parent) == missing


def test_language_shares_separate_tiny_model_noise_from_english():
    for noise in TINY_NOISE:
        words, function, n = language_shares(noise)
        assert n >= 20 and words < 0.75 and function < 0.05, (words, function, noise[:40])
    for _, good in GOOD:
        words, function, _ = language_shares(good)
        assert words >= 0.85 and function >= 0.25, (words, function, good[:40])
    assert language_shares("I'm ready. What's the question?")[0] == 1.0  # contractions are words
    assert language_shares("") == (0.0, 0.0, 0)


def test_well_formed_scaffolds_pass():
    verdicts = _gate().check([(child, parent, "0", TEACHER_TEMPLATE) for parent, child in GOOD])
    assert verdicts == [None] * len(GOOD)


@pytest.mark.parametrize("child,category", [
    (PARENT, "unchanged"),
    (PARENT + " Hint: the result is 56.", "reveals answer"),
    ("Solve the following multiplication: 7 * 9. Give only the result as your final answer.", "drops quantities"),
    ("I'm sorry for your loss, but I'm sorry for the confusion. This is a classic example from the math book.",
     "drops quantities"),
    ("My 7 cats and 8 dogs love long walks in the park on sunny afternoons.", "off topic"),
    ("I'm sorry for your loss, but I'm sorry for the confusion. This is example 7 from the math book, page 8.",
     "off topic"),
    ("The student's attempts and their rewards (1 = correct): 7 * 8 is the problem to solve.", "echoes prompt"),
    ("7 8 " + TINY_NOISE[0], "not language"),  # noise that happens to keep the numbers
    ("7 * 8 " + TINY_NOISE[2], "not language"),
    ("multiplication solve 7 8 result answer final give only", "not language"),  # no grammar at all
])
def test_bad_rewrites_are_rejected_by_category(child, category):
    (reason,) = _gate().check([(child, PARENT, "56", TEACHER_TEMPLATE)])
    assert reason is not None and reason_category(reason) == category, reason


def test_noise_is_rejected_by_language_and_topic_even_with_every_number_kept():
    """Three independent checks stand between the tiny model's noise and the pool: with the language
    bounds off, the topic check still rejects it; with the topic bound off too, only then it passes."""
    noisy = [("7 8 " + n, PARENT, "56", "") for n in TINY_NOISE]
    assert {reason_category(r) for r in _gate().check(noisy)} == {"not language"}
    no_language = _gate(min_word_share=0.0, min_function_share=0.0)
    assert {reason_category(r) for r in no_language.check(noisy)} == {"off topic"}
    assert no_language.check(noisy) != _gate(min_word_share=0.0, min_function_share=0.0,
                                             min_similarity=-1.0).check(noisy)


def test_logprob_bound_is_relative_to_the_parent(tiny_backend):
    """The fluency check compares the child's mean token log-prob under the reference with the parent's.
    Under the tiny random model its own noise scores no worse than English (both within a few nats of
    ln(1/vocab)), so that check alone cannot reject it: that is why the model-free checks come first."""
    texts = [PARENT, GOOD[0][1], "7 8 " + TINY_NOISE[0]]
    lp = mean_logprobs(tiny_backend, texts)
    uniform = -math.log(len(tiny_backend.tokenizer))
    assert all(abs(x - uniform) < 3.0 for x in lp), (lp, uniform)
    assert lp[2] > min(lp[0], lp[1]) - 1.0, lp  # measured: noise -11.2, English -12.4 and -12.5
    # the same score as the backend's own, over the content tokens after the chat template's user prefix
    prefix = tiny_backend.render([{"role": "user", "content": "\x00"}]).split("\x00")[0]
    raw = tiny_backend.score([prefix], [GOOD[0][1]])[0]
    assert lp[1] == pytest.approx(sum(raw) / len(raw))
    # a reference that finds the child 3 nats/token less likely than the parent rejects it at a 2-nat bound
    scores = {PARENT: -3.0, GOOD[0][1]: -6.0}
    strict = RewriteGate(RewriteBounds(max_logprob_drop=2.0), logprobs=lambda ts: [scores[t] for t in ts])
    (reason,) = strict.check([(GOOD[0][1], PARENT, "56", "")])
    assert reason.startswith("not language: mean log-prob -6.00") and "parent's -3.00" in reason
    lenient = RewriteGate(RewriteBounds(max_logprob_drop=3.5), logprobs=lambda ts: [scores[t] for t in ts])
    assert lenient.check([(GOOD[0][1], PARENT, "56", "")]) == [None]


# ---- the leak check: the answer's value in any spelling --------------------------------------------------

from tasks.strategies.gate import check_child  # noqa: E402
from tasks.strategies.numbers import leak_count  # noqa: E402

SEVEN_EIGHT = "Solve the following multiplication: 7 * 8."


@pytest.mark.parametrize("hint,parent,answer", [
    ("Hint: the result is 56.0.", SEVEN_EIGHT, "56"),  # a decimal spelling of an integer
    ("Hint: the result is 56.00", SEVEN_EIGHT, "56"),
    ("Hint: it comes to 1,203.", "Compute 401 * 3.", "1203"),  # thousands separators
    ("Hint: it comes to 1203.", "Compute 401 * 3.", "1,203"),
    ("Hint: the value is 0.5.", "What is 1/4 + 1/4?", "1/2"),  # a fraction's decimal value
    ("Hint: the value is .5", "What is 1/4 + 1/4?", "1/2"),
    (r"Hint: it is $\frac12$.", "What is 1/4 + 1/4?", "1/2"),  # LaTeX, with and without braces
    (r"Hint: it is $\tfrac12$.", "What is 1/4 + 1/4?", "1/2"),
    (r"Hint: it is $\dfrac{1}{2}$.", "What is 1/4 + 1/4?", "1/2"),
    (r"Hint: it is $\frac{2}{4}$.", "What is 1/4 + 1/4?", "1/2"),  # the same value, unreduced
    (r"Hint: it is \frac{1}{2}.", "What is 1/4 + 1/4?", "0.5"),
    ("Hint: one hundred and three.", "Compute 100 + 3.", "103"),  # British "and"
    ("Hint: one thousand and three.", "Compute 1000 + 3.", "1003"),
    ("Hint: the result is \u221256.", "Compute 8 * -7.", "-56"),  # a Unicode minus
])
def test_gate_rejects_the_answers_value_in_any_spelling(hint, parent, answer):
    reason = check_child(f"{parent} {hint}", parent, answer)
    assert reason is not None and reason_category(reason) == "reveals answer", reason


@pytest.mark.parametrize("hint,parent,answer", [
    ("Is it 156, 5.6, 0.56 or 56.5? None of them.", SEVEN_EIGHT, "56"),  # other numbers that contain 56
    ("Think of 1/56 of it, or 560.", SEVEN_EIGHT, "56"),
    ("Half of a half is 1/4.", "What is 1/4 + 1/4?", "1/2"),
    ("One hundred is a round number.", "Compute 100 + 3.", "103"),
])
def test_gate_accepts_other_numbers_that_merely_contain_the_answers_digits(hint, parent, answer):
    assert check_child(f"{parent} {hint}", parent, answer) is None


def test_leak_count_counts_each_spelling_once_and_compares_with_the_parent():
    assert leak_count(r"56, 56.0, fifty-six, \boxed{56} and (B) 56", "56") == 5
    assert leak_count(r"0.5 = 1/2 = \frac12 = 2/4", "1/2") == 4
    assert leak_count("What is 1,203 - 1203 + 0?", "1203") == 2
    # the parent already shows the value: repeating the question is no leak, adding one more spelling is
    assert check_child("What is 1/2 + 0? Think.", "What is 1/2 + 0?", "1/2") is None
    assert check_child("What is 1/2 + 0? It is 0.5.", "What is 1/2 + 0?", "1/2") is not None
