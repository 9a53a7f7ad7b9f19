"""Numbers as questions and answers write them, for the validity gate (tasks/strategies/gate.py; docs/algorithms.md
§3.6): an answer's exact value, how often a text shows it, and the quantities a rewrite must keep.

Choices, and why:
- A numeric answer is compared by value, so every spelling counts: digits with or without a sign, decimals
  ("56.0"), thousands separators ("1,203"), fractions and their decimals ("1/2", "2/4", "0.5", "\\frac12",
  "\\tfrac{1}{2}"), inside LaTeX or a quoted option ("\\boxed{56}", "(B) 56"), and an integer's words
  ("fifty-six", "one hundred and three"); another answer counts as its literal text.
- A leak is the answer's magnitude: "56" in "-56" shows most of -56. A quantity keeps its sign: "7-3" subtracts
  3, "2 - -1" subtracts -1.
"""

from __future__ import annotations

import re
from fractions import Fraction

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


def _words_pattern(n: int) -> str:
    """A regex for `number_words(n)`: hyphen or space between tens and ones, and the British "and" after
    "hundred" or "thousand" ("one hundred and three")."""
    pattern = re.escape(number_words(n)).replace("\\-", "[- ]").replace("\\ ", "\\s+")
    return pattern.replace("hundred\\s+", "hundred(?:\\s+and)?\\s+").replace("thousand\\s+", "thousand(?:\\s+and)?\\s+")


# A number as written, without its sign (a leak is the answer's magnitude: "56" in "-56" shows most of -56):
# a LaTeX fraction whose arguments are braced or single digits (\frac{1}{2}, \tfrac12, \dfrac1{2}); a slash
# fraction (1/2, 1 / 2); a decimal, with thousands separators or a bare leading point (1,203, 56.0, .5).
# Digits inside a word or a longer number are none ("x2", "156", "5.6"), and a digit next to a cloze mask
# ("4__") is none either, since '_' is a word character.
_FRAC_ARG = r"(?:\{\s*(\d+)\s*\}|(\d))"
_WRITTEN_NUMBER = re.compile(
    rf"\\[dt]?frac\s*{_FRAC_ARG}\s*{_FRAC_ARG}"
    r"|(?<![\w.])(\d+)\s*/\s*(\d+)(?!\w|\.\d|\s*/)"
    r"|(?<![\w.])(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?!\w|\.\d)")


def _written_value(m: re.Match) -> Fraction | None:
    g = m.groups()
    if g[0] or g[1]:
        num, den = int(g[0] or g[1]), int(g[2] or g[3])
    elif g[4]:
        num, den = int(g[4]), int(g[5])
    else:
        return Fraction(g[6].replace(",", ""))
    return Fraction(num, den) if den else None


def answer_value(answer: str) -> Fraction | None:
    r"""The exact value of a numeric answer (integer, decimal, fraction, LaTeX fraction; sign, thousands
    separators and surrounding $ allowed), or None for any other answer.

    >>> answer_value("1,203"), answer_value(r"-\dfrac{1}{2}"), answer_value("$0.50$"), answer_value("x + 1")
    (Fraction(1203, 1), Fraction(-1, 2), Fraction(1, 2), None)
    """
    a = answer.strip().strip("$").strip()
    sign = -1 if a[:1] in ("-", "\u2212") else 1
    m = _WRITTEN_NUMBER.fullmatch(a.lstrip("+-\u2212").strip())
    value = _written_value(m) if m else None
    return None if value is None else sign * value


def leak_count(text: str, answer: str) -> int:
    """How often `text` shows `answer`. A numeric answer counts every written number of the same magnitude
    (56, 56.0, -56, \\boxed{56}, "(B) 56"; 1,203 for 1203; 0.5, 2/4, \\frac12 for 1/2) and, for an integer, its
    English words ("fifty-six", "one hundred and three"); any other answer counts its literal occurrences
    outside longer words (case-insensitive)."""
    value = answer_value(answer)
    if value is None:
        literal = re.escape(answer.strip())
        return len(re.findall(rf"(?<![\w.]){literal}(?!\w|\.\d)", text, re.IGNORECASE)) if literal else 0
    count = sum(1 for m in _WRITTEN_NUMBER.finditer(text)
                if (v := _written_value(m)) is not None and abs(v) == abs(value))
    if value.denominator == 1 and abs(value) < 1_000_000:
        # whole words: "fifty" in "fifty-six" is no fifty
        words = _words_pattern(abs(int(value)))
        count += len(re.findall(rf"(?<![\w-]){words}(?!\w|-\w)", text, re.IGNORECASE))
    return count


# ---- quantities ------------------------------------------------------------------------------------------

# a signed number: the minus is a sign only when it does not follow a word or a closing bracket ("7-3" is a
# subtraction of 3, "2 - -1" subtracts -1); thousands separators are dropped ("1,234" is 1234)
_NUMBER = re.compile(r"(?<![\w.])([-−]?)(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?![\w])(?!\.\d)")


def quantities(text: str) -> list[str]:
    """The numbers in `text`, signed and normalised, in order.

    >>> quantities("Calculate 2 - -1, then 7-3 and 1,234 * 0.5 (x2 is no number).")
    ['2', '-1', '7', '3', '1234', '0.5']
    """
    out = []
    for m in _NUMBER.finditer(text):
        digits = m.group(2).replace(",", "") + (m.group(3) or "")
        negative = bool(m.group(1)) and float(digits) != 0
        out.append(("-" if negative else "") + digits)
    return out


def _quantity_count(text: str, value: str) -> int:
    """How often `value` (from `quantities`) occurs in `text`, as a number or in words."""
    count = quantities(text).count(value)
    number = float(value)
    if number.is_integer() and abs(number) < 1_000_000:
        n = int(number)
        words = [_words_pattern(abs(n))]
        words = [rf"(?:minus|negative)\s+{w}" for w in words] if n < 0 else words
        # a negative number's words are not also counted as its magnitude's ("minus seven" is not "seven")
        lead = r"(?<!minus )(?<!negative )" if n >= 0 else ""
        count += sum(len(re.findall(rf"{lead}\b{w}\b", text, re.IGNORECASE)) for w in words)
    return count


def missing_quantities(child: str, parent: str) -> list[str]:
    """The parent's quantities the child does not keep (each as often as the parent has it)."""
    need: dict[str, int] = {}
    for q in quantities(parent):
        need[q] = need.get(q, 0) + 1
    return [q for q, k in need.items() if _quantity_count(child, q) < k]

