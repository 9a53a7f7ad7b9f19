"""The validity gate every refined child passes before it enters the pool (ALGORITHMS.md §3).

A child is rejected, with the reason stored, when
- its text reveals the reference answer more often than its parent's text already did: as digits, as
  words ("fifty-six"), in LaTeX (\\boxed{56}, \\frac{1}{2}), or as a quoted option inside a scaffold
  ("(B) 56"); for multiple-choice children only the stem is checked, since the options must list it;
- it is a multiple-choice reformulation whose correct option does not verify against the original answer,
  or one of whose distractors does;
- it is shorter or longer than the configured bounds.
"""

from __future__ import annotations

import re

from tasks.rewards import exact_match, math_equiv

_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
         "sixteen seventeen eighteen nineteen").split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def number_words(n: int) -> str:
    """English words for an integer below a million in magnitude.

    >>> number_words(56), number_words(-7), number_words(1203)
    ('fifty-six', 'minus seven', 'one thousand two hundred three')
    """
    if n < 0:
        return "minus " + number_words(-n)
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("-" + _ONES[n % 10] if n % 10 else "")
    if n < 1000:
        return _ONES[n // 100] + " hundred" + (" " + number_words(n % 100) if n % 100 else "")
    if n < 1_000_000:
        return number_words(n // 1000) + " thousand" + (" " + number_words(n % 1000) if n % 1000 else "")
    return str(n)


def reveal_patterns(answer: str) -> list[re.Pattern]:
    """Every form of `answer` a leak could take."""
    a = answer.strip()
    forms = {re.escape(a)}
    try:
        value = float(a.replace(",", ""))
        if value.is_integer() and abs(value) < 1_000_000:
            n = int(value)
            forms.add(re.escape(str(n)))
            words = number_words(n)
            forms.add(re.escape(words).replace("\\-", "[- ]").replace("\\ ", "\\s+"))
            if n < 0:
                forms.add(re.escape(number_words(n).replace("minus", "negative")).replace("\\ ", "\\s+"))
    except ValueError:
        pass
    frac = re.fullmatch(r"(-?\d+)\s*/\s*(\d+)", a)
    if frac:
        forms.add(rf"\\[dt]?frac\{{\s*{frac.group(1)}\s*\}}\{{\s*{frac.group(2)}\s*\}}")
    pats = []
    for f in forms:
        # numbers: not inside a longer number ("56" in "156" or "5.6" is no leak); words: whole words
        pats.append(re.compile(rf"(?<![\w.]){f}(?![\w]|\.\d)", re.IGNORECASE))
    return pats


def leak_count(text: str, answer: str) -> int:
    return sum(len(p.findall(text)) for p in reveal_patterns(answer))


def check_child(child_text: str, parent_text: str, answer: str, *, kind: str = "scaffold",
                options: list[str] | None = None, correct: int | None = None,
                min_chars: int = 8, max_chars: int = 4000) -> str | None:
    """None if the child is valid, else the reason it is rejected."""
    if len(child_text.strip()) < min_chars:
        return f"too short ({len(child_text.strip())} chars, min {min_chars})"
    if len(child_text) > max_chars:
        return f"too long ({len(child_text)} chars, max {max_chars})"
    if kind == "mcq":
        if options is None or correct is None:
            return "multiple-choice child without options"
        stem = child_text.split("\nOptions:")[0]
        if leak_count(stem, answer) > leak_count(parent_text, answer):
            return "reveals the answer in the question stem"
        if not (exact_match(options[correct], answer) or math_equiv(options[correct], answer)):
            return f"the correct option {options[correct]!r} does not verify against the answer {answer!r}"
        bad = [o for i, o in enumerate(options) if i != correct and (exact_match(o, answer) or math_equiv(o, answer))]
        if bad:
            return f"distractor {bad[0]!r} verifies as correct"
        return None
    if leak_count(child_text, answer) > leak_count(parent_text, answer):
        return "reveals the answer (digits, words, LaTeX or a quoted option)"
    return None
