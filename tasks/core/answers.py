"""Answer extraction and matching: a completion -> the model's final answer, and plain equality with a reference.

The answer is taken from the final \\boxed{...} or <answer>...</answer>, whichever comes last; outside strict
mode, when there is neither, from "answer is X" or the last number. Extraction choices:
- a final box or answer tag that never closes (the generation was cut inside it) is no answer at all, in
  either mode: not an earlier box (the model had moved on from it), and not the cut box's digits or the last
  number (a prefix of the value being written: `\\boxed{4` may have been `\\boxed{42}`), so a cut-off
  generation never earns a reward by chance;
- the minus signs U+2212, U+FE63 and U+FF0D are read as "-" everywhere (the en dash is not: it marks ranges);
- after "answer is", a full stop ends the answer only when no digit follows it, so "3.5." is 3.5.
`exact_match` compares normalised strings, or numbers by value ("1,000" is 1000, "-5.0" is "−5"). Model output
is only ever parsed as text, never executed. The verifiers that use these are in tasks/core/rewards.py.
"""

from __future__ import annotations

import re

_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*\$?([^\n$]*?)\$?\s*(?:\.(?!\d)|$|\n)", re.IGNORECASE)
_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-"})
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][-+]?\d+)?(?:/\d+)?")
_LATEX_MATH = re.compile(r"\\[dt]?frac|\\sqrt|\\pi|\^")  # an "answer is" phrase math-verify should parse whole


def _last_box(text: str) -> tuple[int, str | None]:
    """(where the last \\boxed command starts, its contents with nested braces balanced), or (-1, None) when
    there is none; contents None when the text ends before its brace group closes (a cut box). A \\boxed
    followed by anything but a brace (another macro's name) is not a box."""
    start = text.rfind("\\boxed")
    while start != -1:
        after = start + len("\\boxed")
        i = len(text) - len(text[after:].lstrip())  # the first non-space character after the command
        if i == len(text):
            return start, None  # cut right after "\\boxed"
        if text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return start, text[i + 1 : j].strip()
            return start, None  # cut inside the box
        start = text.rfind("\\boxed", 0, start)
    return -1, None


def last_boxed(text: str) -> str | None:
    """Contents of the last \\boxed{...}, with nested braces balanced; None when there is none or the last one
    is cut (never an earlier box instead).

    >>> last_boxed(r"so \\boxed{\\frac{1}{2}} and then \\boxed{42}")
    '42'
    >>> last_boxed(r"so \\boxed{41} and then \\boxed{4") is None
    True
    """
    return _last_box(text)[1]


def _last_answer_tag(text: str) -> tuple[int, str | None]:
    """(where the last <answer> tag opens, its contents), as _last_box; contents None when it never closes."""
    lower = text.lower()
    start = lower.rfind("<answer>")
    if start == -1:
        return -1, None
    end = lower.find("</answer>", start)
    return start, (text[start + len("<answer>") : end].strip() if end != -1 else None)


def extract_answer(text: str, strict: bool = False) -> str | None:
    """The model's final answer, or None. Strict mode accepts only \\boxed{} or <answer> tags.

    >>> extract_answer("The answer is 4.")
    '4'
    >>> extract_answer("The answer is \u22123.5.")
    '-3.5'
    >>> extract_answer("7 * 8 = 56, so <answer>56</answer>")
    '56'
    >>> extract_answer("56", strict=True) is None
    True
    >>> extract_answer(r"\\boxed{56}, or rather \\boxed{5") is None  # cut in its final box: no answer
    True
    """
    text = text.translate(_MINUS_SIGNS)
    box_at, boxed = _last_box(text)
    tag_at, tagged = _last_answer_tag(text)
    if box_at != -1 or tag_at != -1:
        return boxed if box_at > tag_at else tagged  # whichever opens last is final; None if it was cut
    if strict:
        return None
    said = _ANSWER_IS.findall(text)
    if said and said[-1].strip():
        return _stated_answer(said[-1].strip())
    nums = _NUMBER.findall(text)
    if nums:
        return nums[-1]
    letter = re.fullmatch(r"\(?([A-J])\)?\.?", text.strip())  # a bare option letter, for multiple choice
    return letter.group(1) if letter else None


def _stated_answer(phrase: str) -> str:
    """The answer in the phrase after "answer is": the whole phrase when it is LaTeX math (math-verify parses
    it; its last number would be a denominator), else the first number after the last '=' ("7*8 = 56"), else
    the first number (not the last: "12, not 13" is 12), else the phrase itself.

    >>> [_stated_answer(p) for p in ("12, not 13", "12 apples and 3 pears", "7 * 8 = 56", r"-\\frac{3}{4}", "2.5e3")]
    ['12', '12', '56', '-\\\\frac{3}{4}', '2.5e3']
    """
    if _LATEX_MATH.search(phrase):
        return phrase.strip("$ ")
    nums = _NUMBER.findall(phrase.rsplit("=", 1)[-1]) or _NUMBER.findall(phrase)
    return nums[0] if nums else phrase


def _normalise(s: str) -> str:
    s = s.strip().translate(_MINUS_SIGNS).strip("$ .").lower()
    s = re.sub(r"^\\text\{(.*)\}$", r"\1", s)
    if _NUMBER.fullmatch(s) and "/" not in s:
        value = float(s.replace(",", ""))
        return str(int(value)) if value.is_integer() else repr(value)
    return re.sub(r"\s+", " ", s)


def exact_match(pred: str | None, ref: str) -> float:
    """1.0 when normalised strings or numbers are equal.

    >>> exact_match("1,000", "1000"), exact_match("-5.0", "−5"), exact_match("6", "7")
    (1.0, 1.0, 0.0)
    """
    return float(pred is not None and _normalise(pred) == _normalise(ref))
