"""Verifiers: a completion and its prompt's reference -> a reward in [0, 1] and `correct` (reward 1.0 only).

- `rg`: reasoning-gym's own `score_answer` for the prompt's source task (it may give partial credit);
- `math`: math-verify equivalence, run in a worker process that a timeout can kill
  (tasks/core/math_verify_worker.py): a check that overruns its timeout scores 0 and is flagged
  (`Verdict.timed_out`, counted by the collect and evaluate stages);
- `exact`: normalised string / numeric equality.
`auto` picks rg for rg: sources, else math. The answer is extracted first (tasks/core/answers.py: the final
\\boxed{} or <answer> tag, or outside strict mode "answer is X" or the last number); on a multiple-choice rung
of the format ladder a bare option letter stands for its option's value. An optional format reward mixes in
whether a strict answer (box or tag) was given. Model output is only ever parsed as text, never executed.

The extraction and math-verify names stay importable from here (`extract_answer`, `exact_match`,
`math_equiv`, `MATH_VERIFY`, ...), where callers import them.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from models.config import Section
from tasks.core.answers import exact_match, extract_answer, last_boxed
from tasks.core.math_verify_worker import (
    MATH_VERIFY,
    MATH_VERIFY_TIMEOUT_S,
    MAX_VERIFY_CHARS,
    MathVerifyWorker,
    math_check,
    math_equiv,
)

__all__ = ["LETTERS", "MATH_VERIFY", "MATH_VERIFY_TIMEOUT_S", "MAX_VERIFY_CHARS", "MCQ_LEVELS", "MathVerifyWorker",
           "RewardConfig", "Verdict", "exact_match", "extract_answer", "last_boxed", "math_check", "math_equiv",
           "mcq_options", "option_value", "rg_score", "verify"]


class RewardConfig(Section):
    """How answers are verified and scored (docs/algorithms.md §1)."""

    verifier: Literal["auto", "rg", "math", "exact"] = Field("auto", description="auto: rg for rg: sources, else math")
    strict: bool = Field(False, description="only \\boxed{} or `<answer>` tags count as an answer")
    format_weight: float = Field(0.0, ge=0.0, le=1.0, description="weight of the format reward")


log = logging.getLogger("refinery.verify")


@dataclass(frozen=True)
class Verdict:
    reward: float
    correct: bool
    extracted: str | None
    timed_out: bool = False  # the math-verify check overran its timeout (and scored 0)


def rg_score(pred: str | None, ref: str, task: str, question: str, meta: str | None) -> float:
    """reasoning-gym's score_answer for `task` (partial credit possible), clipped to [0, 1]."""
    import reasoning_gym

    entry = {"question": question, "answer": ref, "metadata": json.loads(meta) if meta else {}}
    try:
        score = reasoning_gym.get_score_answer_fn(task)(pred, entry)
    except Exception:  # a scorer that chokes on malformed output scores it as wrong
        return 0.0
    return min(1.0, max(0.0, float(score or 0.0)))


# How a bare letter is read on the format ladder's multiple-choice rungs (tasks/strategies/ladder.py makes them): the
# verifier needs it, so it lives here and the ladder imports it (one direction: ladder -> rewards).
LETTERS = "ABCDEFGHIJ"
MCQ_LEVELS = ("mcq4", "mcq10")


def mcq_options(meta: str | dict | None) -> list[str]:
    """The options a bare letter may stand for: a multiple-choice rung's, and none on any other prompt. A cloze
    or open rung is answered with the value, even if its stored meta carries a parent's options (cloze
    children made before their meta started from the root's inherited their mcq10 parent's).

    >>> mcq_options('{"level": "mcq4", "options": ["1", "2"]}'), mcq_options('{"level": "cloze", "options": ["1"]}')
    (['1', '2'], [])
    """
    meta = json.loads(meta) if isinstance(meta, str) else (meta or {})
    return list(meta.get("options") or []) if meta.get("level") in MCQ_LEVELS else []


def option_value(pred: str | None, options: list[str]) -> str | None:
    """Map a bare option letter ('B', '(B)') to its value; anything else passes through."""
    if pred is None:
        return None
    m = re.fullmatch(r"\(?([A-J])\)?\.?", pred.strip())
    if m and LETTERS.index(m.group(1)) < len(options):
        return options[LETTERS.index(m.group(1))]
    return pred


def verify(
    completion: str,
    answer: str,
    source: str,
    question: str = "",
    meta: str | None = None,
    verifier: str = "auto",
    strict: bool = False,
    format_weight: float = 0.0,
    math_timeout: float | None = None,
) -> Verdict:
    """Score one completion. `auto` uses reasoning-gym for rg: sources, math-verify otherwise (bounded by
    `math_timeout` seconds; a timeout scores 0 and sets `timed_out`)."""
    pred = extract_answer(completion, strict=strict)
    if meta and '"options"' in meta:  # on an mcq rung (only) a bare letter stands for its option's value
        pred = option_value(pred, mcq_options(meta))
    kind = verifier if verifier != "auto" else ("rg" if source.startswith("rg:") else "math")
    timed_out = False
    if kind == "rg":
        if not source.startswith("rg:"):
            raise ValueError(f"verifier 'rg' needs an rg: source, got {source!r}")
        score = rg_score(pred, answer, source[3:], question, meta)
    elif kind == "math":
        score, timed_out = math_check(pred, answer, math_timeout)
    elif kind == "exact":
        score = exact_match(pred, answer)
    else:
        raise ValueError(f"unknown verifier {verifier!r}: use auto, rg, math or exact")
    correct = score >= 1.0
    if format_weight:
        formatted = extract_answer(completion, strict=True) is not None
        score = (1 - format_weight) * score + format_weight * float(formatted)
    return Verdict(reward=score, correct=correct, extracted=pred, timed_out=timed_out)
