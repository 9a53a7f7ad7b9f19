"""Verifiers: a completion and its prompt's reference -> a reward in [0, 1] and `correct` (reward 1.0 only).

- `rg`: reasoning-gym's own `score_answer` for the prompt's source task (it may give partial credit);
- `math`: math-verify equivalence. Its own timeouts use SIGALRM, which breaks off the main thread, so they
  are disabled and the call is bounded here instead, on a worker thread;
- `exact`: normalised string / numeric equality.
The answer is taken from the last \\boxed{...} or <answer>...</answer>; outside strict mode, from "answer is
X" or the last number. Model output is only ever parsed as text, never executed.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from functools import cache

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*\$?([^\n$]*?)\$?\s*(?:\.|$|\n)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")
MAX_VERIFY_CHARS = 2_000  # longer extracted answers are wrong for our sources, and slow to parse


@dataclass(frozen=True)
class Verdict:
    reward: float
    correct: bool
    extracted: str | None


def last_boxed(text: str) -> str | None:
    """Contents of the last \\boxed{...}, with nested braces balanced.

    >>> last_boxed(r"so \\boxed{\\frac{1}{2}} and then \\boxed{42}")
    '42'
    """
    start = text.rfind("\\boxed")
    while start != -1:
        i = text.find("{", start)
        if i != -1 and text[start + 6 : i].strip() == "":
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return text[i + 1 : j].strip()
        start = text.rfind("\\boxed", 0, start)
    return None


def extract_answer(text: str, strict: bool = False) -> str | None:
    """The model's final answer, or None. Strict mode accepts only \\boxed{} or <answer> tags.

    >>> extract_answer("The answer is 4.")
    '4'
    >>> extract_answer("7 * 8 = 56, so <answer>56</answer>")
    '56'
    >>> extract_answer("56", strict=True) is None
    True
    """
    boxed = last_boxed(text)
    tags = _ANSWER_TAG.findall(text)
    if boxed is not None or tags:
        # whichever appears last in the text wins
        if boxed is not None and (not tags or text.rfind("\\boxed") > text.rfind("<answer>")):
            return boxed
        return tags[-1].strip()
    if strict:
        return None
    said = _ANSWER_IS.findall(text)
    if said and said[-1].strip():
        nums = _NUMBER.findall(said[-1])
        return nums[-1] if nums else said[-1].strip()
    nums = _NUMBER.findall(text.replace("\u2212", "-"))
    if nums:
        return nums[-1]
    letter = re.fullmatch(r"\(?([A-J])\)?\.?", text.strip())  # a bare option letter, for multiple choice
    return letter.group(1) if letter else None


def _normalise(s: str) -> str:
    s = s.strip().replace("\u2212", "-").strip("$ .").lower()
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


@cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=2, thread_name_prefix="math-verify")


def _math_verify(pred: str, ref: str) -> bool:
    import logging

    from math_verify import parse, verify

    # it warns on every call that its (SIGALRM) timeouts are off; they are, on purpose: see module docstring
    logging.getLogger("math_verify").setLevel(logging.ERROR)

    gold = parse(f"${ref}$", parsing_timeout=None)
    guess = parse(f"${pred}$", parsing_timeout=None)
    return bool(gold and guess and verify(gold, guess, timeout_seconds=None))


def math_equiv(pred: str | None, ref: str, timeout: float = 5.0) -> float:
    """math-verify equivalence, bounded by `timeout` seconds (a timeout scores 0)."""
    if pred is None or len(pred) > MAX_VERIFY_CHARS:
        return 0.0
    if exact_match(pred, ref):
        return 1.0
    try:
        return float(_pool().submit(_math_verify, pred, ref).result(timeout=timeout))
    except FutureTimeout:
        return 0.0
    except Exception:  # math-verify raises assorted errors on malformed LaTeX: malformed means wrong
        return 0.0


def rg_score(pred: str | None, ref: str, task: str, question: str, meta: str | None) -> float:
    """reasoning-gym's score_answer for `task` (partial credit possible), clipped to [0, 1]."""
    import reasoning_gym

    entry = {"question": question, "answer": ref, "metadata": json.loads(meta) if meta else {}}
    try:
        score = reasoning_gym.get_score_answer_fn(task)(pred, entry)
    except Exception:  # a scorer that chokes on malformed output scores it as wrong
        return 0.0
    return min(1.0, max(0.0, float(score or 0.0)))


def verify(
    completion: str,
    answer: str,
    source: str,
    question: str = "",
    meta: str | None = None,
    verifier: str = "auto",
    strict: bool = False,
    format_weight: float = 0.0,
) -> Verdict:
    """Score one completion. `auto` uses reasoning-gym for rg: sources, math-verify otherwise."""
    pred = extract_answer(completion, strict=strict)
    if meta and '"options"' in meta:  # a multiple-choice variant: a bare letter stands for its option's value
        from tasks.ladder import option_value

        pred = option_value(pred, json.loads(meta).get("options") or [])
    kind = verifier if verifier != "auto" else ("rg" if source.startswith("rg:") else "math")
    if kind == "rg":
        if not source.startswith("rg:"):
            raise ValueError(f"verifier 'rg' needs an rg: source, got {source!r}")
        score = rg_score(pred, answer, source[3:], question, meta)
    elif kind == "math":
        score = math_equiv(pred, answer)
    elif kind == "exact":
        score = exact_match(pred, answer)
    else:
        raise ValueError(f"unknown verifier {verifier!r}: use auto, rg, math or exact")
    correct = score >= 1.0
    if format_weight:
        formatted = extract_answer(completion, strict=True) is not None
        score = (1 - format_weight) * score + format_weight * float(formatted)
    return Verdict(reward=score, correct=correct, extracted=pred)
