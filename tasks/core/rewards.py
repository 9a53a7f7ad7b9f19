"""Verifiers: a completion and its prompt's reference -> a reward in [0, 1] and `correct` (reward 1.0 only).

- `rg`: reasoning-gym's own `score_answer` for the prompt's source task (it may give partial credit);
- `math`: math-verify equivalence, run in a separate worker process. math-verify's own timeouts use SIGALRM
  (main thread only), and a thread cannot bound it either: sympy evaluates e.g. 10^{10^{10}} exactly, a
  big-integer power that holds the GIL for minutes, so a timed wait on a worker thread never even returns,
  and a stuck thread cannot be stopped. A process can be: a check that overruns its timeout scores 0, is
  flagged (`Verdict.timed_out`, counted by the collect and evaluate stages) and logged, and its worker is
  killed and replaced, so the next check starts on a fresh one;
- `exact`: normalised string / numeric equality.
The answer is taken from the final \\boxed{...} or <answer>...</answer>, whichever comes last; outside strict
mode, when there is neither, from "answer is X" or the last number. Extraction choices:
- a final box or answer tag that never closes (the generation was cut inside it) is no answer at all, in
  either mode: not an earlier box (the model had moved on from it), and not the cut box's digits or the last
  number (a prefix of the value being written: `\\boxed{4` may have been `\\boxed{42}`), so a cut-off
  generation never earns a reward by chance;
- the minus signs U+2212, U+FE63 and U+FF0D are read as "-" everywhere (the en dash is not: it marks ranges);
- after "answer is", a full stop ends the answer only when no digit follows it, so "3.5." is 3.5.
Model output is only ever parsed as text, never executed.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import select
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field

from models.config import Section


class RewardConfig(Section):
    verifier: Literal["auto", "rg", "math", "exact"] = Field("auto", description="auto: rg for rg: sources, else math")
    strict: bool = Field(False, description="only \\boxed{} or `<answer>` tags count as an answer")
    format_weight: float = Field(0.0, ge=0.0, le=1.0, description="weight of the format reward")

_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*\$?([^\n$]*?)\$?\s*(?:\.(?!\d)|$|\n)", re.IGNORECASE)
_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-"})
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][-+]?\d+)?(?:/\d+)?")
_LATEX_MATH = re.compile(r"\\[dt]?frac|\\sqrt|\\pi|\^")  # an "answer is" phrase math-verify should parse whole
MAX_VERIFY_CHARS = 2_000  # longer extracted answers are wrong for our sources, and slow to parse
MATH_VERIFY_TIMEOUT_S = 5.0
log = logging.getLogger("refinery.verify")


@dataclass(frozen=True)
class Verdict:
    reward: float
    correct: bool
    extracted: str | None
    timed_out: bool = False  # the math-verify check overran its timeout (and scored 0)


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


def _serve_math_verify() -> None:
    """The worker process's loop: one JSON [pred, ref] per stdin line -> "1" or "0" per stdout line."""
    if sys.platform.startswith("linux"):
        import ctypes

        # die with the parent even mid-check (stdin's EOF is only read between checks), or a SIGKILLed run
        # would leave a hung check computing for minutes
        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    from math_verify import parse
    from math_verify import verify as mv_verify

    # it warns on every call that its (SIGALRM) timeouts are off; they are, on purpose: see module docstring
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    replies = sys.stdout
    sys.stdout = sys.stderr  # a library's stray print must never be taken for a reply
    replies.write("ready\n")
    replies.flush()
    for line in sys.stdin:
        pred, ref = json.loads(line)
        try:
            gold = parse(f"${ref}$", parsing_timeout=None)
            guess = parse(f"${pred}$", parsing_timeout=None)
            ok = bool(gold and guess and mv_verify(gold, guess, timeout_seconds=None))
        except Exception:  # math-verify raises assorted errors on malformed LaTeX: malformed means wrong
            ok = False
        replies.write("1\n" if ok else "0\n")
        replies.flush()


class MathVerifyWorker:
    """A math-verify worker process, started on first use and replaced after a timeout (or a crash).

    Checks are serialised by a lock (one process, one check at a time); a forked child starts its own worker.
    The start-up (importing sympy, about 0.5 s) is not charged to the first check's timeout. On Linux the
    worker gets SIGKILL when the thread that started it ends (PR_SET_PDEATHSIG), so it never outlives its
    process; the next check then starts a fresh one.
    """

    START_TIMEOUT_S = 120.0  # importing sympy on a loaded 2-core machine can take seconds

    def __init__(self) -> None:
        self._forget()
        self.timeouts = 0  # checks that overran, in this process's lifetime
        self.starts = 0

    def _forget(self) -> None:
        """A fresh state: also what a forked child gets, so it never shares its parent's pipes or a held lock."""
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        root = str(Path(__file__).resolve().parents[2])  # the worker imports tasks.core.rewards from this checkout
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        with tempfile.TemporaryFile() as errors:  # closed whether or not the worker starts
            proc = subprocess.Popen([sys.executable, "-c", "from tasks.core.rewards import _serve_math_verify as s; s()"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, env=env,
                                    text=True, bufsize=1, start_new_session=True)  # Ctrl-C goes to us, not to it
            ready = select.select([proc.stdout], [], [], self.START_TIMEOUT_S)[0] and proc.stdout.readline()
            if ready != "ready\n":
                self._kill(proc)
                errors.seek(0)
                tail = errors.read().decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
                raise RuntimeError(f"the math-verify worker process did not start: {tail[0]}")
        self.starts += 1
        return proc

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            pipe.close()

    def check(self, pred: str, ref: str, timeout: float) -> bool | None:
        """math-verify's verdict on pred == ref, or None if it overran `timeout` seconds (the worker is
        then killed, and the next check starts a new one)."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            proc = self._proc
            try:
                proc.stdin.write(json.dumps([pred, ref]) + "\n")
                proc.stdin.flush()
            except BrokenPipeError:  # it died between checks (killed from outside): one retry on a fresh one
                self._kill(proc)
                self._proc = proc = self._start()
                proc.stdin.write(json.dumps([pred, ref]) + "\n")
                proc.stdin.flush()
            if select.select([proc.stdout], [], [], timeout)[0]:
                reply = proc.stdout.readline()
                if reply in ("1\n", "0\n"):
                    return reply == "1\n"
            self.timeouts += 1  # no reply in time, or it died mid-check: either way this check cost its budget
            self._kill(proc)
            self._proc = None
            return None

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._kill(self._proc)
            self._proc = None


MATH_VERIFY = MathVerifyWorker()
atexit.register(MATH_VERIFY.close)
os.register_at_fork(after_in_child=MATH_VERIFY._forget)


def math_check(pred: str | None, ref: str, timeout: float | None = None) -> tuple[float, bool]:
    """(score, timed_out): math-verify equivalence, bounded by `timeout` seconds (default
    MATH_VERIFY_TIMEOUT_S; a timeout scores 0)."""
    timeout = MATH_VERIFY_TIMEOUT_S if timeout is None else timeout
    if pred is None or len(pred) > MAX_VERIFY_CHARS:
        return 0.0, False
    if exact_match(pred, ref):
        return 1.0, False
    ok = MATH_VERIFY.check(pred, ref, timeout)
    if ok is None:
        log.warning("math-verify timed out after %.1f s on answer %.80r (reference %.40r): scored 0, worker "
                    "replaced (%d timeouts so far)", timeout, pred, ref, MATH_VERIFY.timeouts)
        return 0.0, True
    return float(ok), False


def math_equiv(pred: str | None, ref: str, timeout: float | None = None) -> float:
    """math-verify equivalence, bounded by `timeout` seconds (a timeout scores 0)."""
    return math_check(pred, ref, timeout)[0]


def report_timeouts(stage: str, round: int, n: int) -> None:
    """One warning line for a stage whose math-verify checks timed out: in Prefect's run log inside a run
    (where the UI shows it), else on this module's logger."""
    if not n:
        return
    msg = f"{stage} round {round}: {n} math-verify check(s) timed out and scored 0"
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        get_run_logger().warning(msg)
    except MissingContextError:
        log.warning(msg)


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
