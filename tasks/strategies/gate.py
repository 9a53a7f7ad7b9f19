"""The validity gate every refined child passes before it enters the pool (docs/algorithms.md §3).

Every rejection reason reads `<category>: <detail>`, and the category (the text before the first colon) is
one of a fixed set, so SQL counts rejections per category with `split_part(reason, ':', 1)`:

- `too short`, `too long`: outside the configured length bounds;
- `reveals answer`: the text shows the reference answer more often than its parent's text already did
  (tasks/strategies/numbers.py reads the numbers). A numeric answer is compared by value, so every spelling
  counts: digits with or without a sign, decimals ("56.0"), thousands separators ("1,203"), fractions and
  their decimals ("1/2", "2/4", "0.5", "\\frac12", "\\tfrac{1}{2}"), inside LaTeX or a quoted option
  ("\\boxed{56}", "(B) 56"), and an integer's words ("fifty-six", "one hundred and three"); another answer
  counts as its literal text. For multiple-choice children only the stem is checked, since the options must
  list it; a cloze pattern that masks no digit reveals the answer too;
- `bad pattern`: a cloze child whose pattern (after the last ": " of its last line) is not the answer with
  50-80% of its digits, and at least one digit kept, masked by '_';
- `bad options`: a multiple-choice child whose correct option does not verify against the original answer,
  or one of whose distractors does;
- `unsupported`: the strategy cannot make this child (no reference solution, no numeric distractors, ...);
- `duplicate`: the child is already in the run's pool (set by the refine stage).

Free text that replaces a question (a teacher_scaffold rewrite) must also be a coherent question about the
same problem; `RewriteGate` checks, cheapest first:
- `unchanged`: it repeats the parent;
- `drops quantities`: some number of the parent is missing (as digits with the same sign, or in words), each
  as often as the parent has it. Parents without numbers pass this check; the topic check below carries them;
- `echoes prompt`: it copies a five-word run of the teacher's prompt (the instructions, or a quoted attempt)
  that the parent does not have ("attempts and their rewards correct"): the teacher talked about the task
  instead of writing the problem;
- `not language`: too few of its words are dictionary words (the packaged MiniLM's WordPiece vocabulary of
  whole words; a word with a capital after a small letter, "sepsisoker", is no word), or, from 5 words on,
  too few are English function words (the, of, is, ...). Both hold whatever the policy is: noise decoded
  from a 49k BPE vocabulary is mostly content words and fused fragments, never grammar;
- `off topic`: its MiniLM cosine similarity to the parent is below a bound;
- `not language` again: its mean token log-prob under the reference model (the run's base policy, version
  0), scored as a user message, is more than a bound below the parent's. This is the check that rejects
  English word salad, but under a random model every text scores about ln(vocabulary size), which is why the
  model-free checks above come first.
Two more categories mark rows the gate never judged, recorded by the refine stage for a scaffold it could
not ask for; they are not counted as gate rejections (the run summary counts `teacher unavailable` per prompt
on its own):
- `teacher unavailable`: the teacher call failed (down, slow, rate-limited past its retries, garbage);
- `empty answer`: the teacher answered with nothing.
Default bounds were calibrated on 20 real rewrites by the embedded SmolLM2-135M as teacher, 20 by the tiny
random model, 11 hand-written good scaffolds and 4 off-topic or word-salad ones (figures in `RewriteBounds`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

from models.backend import Backend
from tasks.core.answers import exact_match
from tasks.core.math_verify_worker import math_equiv
from tasks.strategies.numbers import leak_count, missing_quantities, quantities

UNAVAILABLE, EMPTY_ANSWER = "teacher unavailable", "empty answer"
NOT_JUDGED = frozenset({UNAVAILABLE, EMPTY_ANSWER})  # categories of rows the gate never saw


def reason_category(reason: str) -> str:
    """The stable category of a rejection reason: the text before its first colon.

    >>> reason_category("drops quantities: 8 missing (the parent has 7, 8)")
    'drops quantities'
    """
    return reason.split(":", 1)[0].strip()


@dataclass(frozen=True)
class Lengths:
    """A child's length bounds in characters (refine.gate_min_chars, refine.gate_max_chars)."""

    min_chars: int = 8
    max_chars: int = 4000


LENGTHS = Lengths()  # the default bounds

def check_child(child_text: str, parent_text: str, answer: str, *, kind: str = "scaffold",
                options: list[str] | None = None, correct: int | None = None,
                min_chars: int = Lengths.min_chars, max_chars: int = Lengths.max_chars) -> str | None:
    """None if the child is valid, else the reason it is rejected (the checks every child passes; a rewrite
    also passes `RewriteGate`). `kind`: "mcq" (options checked, stem leak-checked), "cloze" (pattern checked
    too) or any other child."""
    if len(child_text.strip()) < min_chars:
        return f"too short: {len(child_text.strip())} chars (min {min_chars})"
    if len(child_text) > max_chars:
        return f"too long: {len(child_text)} chars (max {max_chars})"
    if kind == "mcq":
        if options is None or correct is None:
            return "bad options: a multiple-choice child without options"
        stem = child_text.split("\nOptions:")[0]
        if leak_count(stem, answer) > leak_count(parent_text, answer):
            return "reveals answer: in the question stem"
        if not (exact_match(options[correct], answer) or math_equiv(options[correct], answer)):
            return f"bad options: the correct option {options[correct]!r} does not verify against {answer!r}"
        bad = [o for i, o in enumerate(options) if i != correct and (exact_match(o, answer) or math_equiv(o, answer))]
        if bad:
            return f"bad options: distractor {bad[0]!r} verifies as correct"
        return None
    if leak_count(child_text, answer) > leak_count(parent_text, answer):
        return "reveals answer: as digits, words, LaTeX or a quoted option"
    if kind == "cloze":
        return cloze_reason(child_text.rstrip().rsplit("\n", 1)[-1].rsplit(": ", 1)[-1].strip(), answer)
    return None


def cloze_mask_counts(digits: int) -> range:
    """How many of an answer's `digits` a cloze pattern may mask: 50-80% of them, and never all.

    >>> list(cloze_mask_counts(2)), list(cloze_mask_counts(6)), list(cloze_mask_counts(10))
    ([1], [3, 4], [5, 6, 7, 8])
    """
    return range((digits + 1) // 2, (4 * digits) // 5 + 1)


def cloze_reason(pattern: str, answer: str) -> str | None:
    """None if `pattern` is `answer` with 50-80% of its digits (and not all) masked by '_', else why not.

    >>> cloze_reason("4__", "456"), cloze_reason("456", "456"), cloze_reason("5__", "456")
    (None, "reveals answer: the cloze pattern '456' masks no digit", "bad pattern: '5__' is not the answer '456' with digits masked")
    """
    a = answer.strip()
    fits = len(pattern) == len(a) and all(p == c or (p == "_" and c.isdigit()) for p, c in zip(pattern, a))
    if not fits:
        return f"bad pattern: {pattern!r} is not the answer {a!r} with digits masked"
    masked, digits = pattern.count("_"), sum(c.isdigit() for c in a)
    if masked == 0:
        return f"reveals answer: the cloze pattern {pattern!r} masks no digit"
    if masked not in cloze_mask_counts(digits):
        return f"bad pattern: {pattern!r} masks {masked} of {digits} digits (50-80%, at least one kept)"
    return None


# ---- language --------------------------------------------------------------------------------------------

_WORD = re.compile(r"[A-Za-z]+(?:['’][A-Za-z]+)?")
FUNCTION_WORDS = frozenset("""
a an the and or but if then so as of to in on at by for with from into about than that this these those it its
is are was were be been being am do does did done have has had not no nor can could will would shall should may
might must i you he she we they me him her us them my your his our their what which who whom whose when where
why how all any each every some such only own same other more most very too just also there here up down out
over under again one two three four five six seven eight nine ten first next now""".split())


@cache
def dictionary() -> frozenset[str]:
    """Whole English words: the alphabetic, non-continuation entries of the packaged MiniLM's WordPiece
    vocabulary (lower case; about 20k words)."""
    from tasks.selectors.embed import minilm_path

    entries = (minilm_path() / "vocab.txt").read_text(encoding="utf-8").split("\n")
    return frozenset(w for w in entries if w.isalpha() and w.isascii())


def language_shares(text: str) -> tuple[float, float, int]:
    """(share of dictionary words, share of function words, number of words) of `text`'s words."""
    words = [w.replace("’", "'").split("'")[0] for w in _WORD.findall(text)]
    if not words:
        return 0.0, 0.0, 0
    vocab = dictionary()
    # a capital after a small letter ("storiesKB", "judgeUblic") marks BPE fragments fused into one string
    shaped = [w for w in words if w.islower() or w.isupper() or w.istitle()]
    known = sum(1 for w in shaped if w.lower() in vocab)
    function = sum(1 for w in words if w.lower() in FUNCTION_WORDS)
    return known / len(words), function / len(words), len(words)


def _ngrams(text: str, n: int = 5) -> set[tuple[str, ...]]:
    words = [w.lower() for w in _WORD.findall(text)]
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


# ---- the rewrite gate ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RewriteBounds:
    """Bounds of `RewriteGate`, with the calibration figures (min / max over each set) they sit between.

    - min_similarity 0.5: hand-written good scaffolds 0.59-0.96, tiny-model noise -0.08-0.09, SmolLM2-135M
      rewrites 0.06-0.65 (the ones above 0.5 keep no quantities, leak, or echo the instructions);
    - min_word_share 0.75: good 0.89-1.00, noise 0.32-0.60;
    - min_function_share 0.15 (from 5 words): good 0.32-0.62, noise 0.00-0.02, 135M 0.20-1.00;
    - max_logprob_drop 2.0 nats per token below the parent under SmolLM2-135M: good -0.56..+1.59, English
      word salad keeping the numbers -2.62, tiny-model noise -10.3..-8.4.
    """

    min_similarity: float = 0.5
    min_word_share: float = 0.75
    min_function_share: float = 0.15
    max_logprob_drop: float = 2.0
    function_words_from: int = 5  # a shorter text is too short to judge its grammar by function words
    lengths: Lengths = LENGTHS


LogProbs = Callable[[list[str]], list[float]]  # texts -> mean token log-prob of each under the reference
Embed = Callable[[list[str]], "object"]  # texts -> L2-normalised vectors, one row per text


def _minilm(texts: list[str]):
    from tasks.selectors.embed import embed_minilm

    return embed_minilm(texts)


def mean_logprobs(backend: Backend, texts: list[str]) -> list[float]:
    """Mean token log-prob of each text under `backend`, scored as the content of a user message (the
    backend's own chat template up to where the content starts)."""
    marker = "\x00CONTENT\x00"
    rendered = backend.render([{"role": "user", "content": marker}])
    prefix = rendered.split(marker)[0] if marker in rendered else ""
    scores = backend.score([prefix] * len(texts), texts)  # T = 1: fluency under the model itself, no sampler
    return [sum(s) / len(s) if s else float("-inf") for s in scores]


class RewriteGate:
    """Judges free-text rewrites of a question in batches: text checks first, then one MiniLM call for all
    survivors, then one reference-model scoring call for those still standing (skipped when `logprobs` is
    None, or loaded lazily by the caller only when something reaches it)."""

    def __init__(self, bounds: RewriteBounds = RewriteBounds(), embed: Embed = _minilm,
                 logprobs: LogProbs | None = None):
        self.bounds, self.embed, self.logprobs = bounds, embed, logprobs

    def text_reason(self, child: str, parent: str, answer: str, prompt: str = "") -> str | None:
        """The model-free checks, in order. `prompt`: what the teacher was asked (its runs must not be
        parroted)."""
        lengths = self.bounds.lengths
        reason = check_child(child, parent, answer, min_chars=lengths.min_chars, max_chars=lengths.max_chars)
        if reason:
            return reason
        if " ".join(child.split()) == " ".join(parent.split()):
            return "unchanged: the rewrite repeats the parent"
        missing = missing_quantities(child, parent)
        if missing:
            return f"drops quantities: {', '.join(missing)} missing (the parent has {', '.join(quantities(parent))})"
        echoed = sorted((_ngrams(prompt) & _ngrams(child)) - _ngrams(parent))
        if echoed:
            return f"echoes prompt: copies {' '.join(echoed[0])!r} from what the teacher was asked"
        b = self.bounds
        words, function, n = language_shares(child)
        if words < b.min_word_share:
            return f"not language: {words:.0%} of its words are dictionary words (min {b.min_word_share:.0%})"
        if n >= b.function_words_from and function < b.min_function_share:
            return f"not language: {function:.0%} function words (min {b.min_function_share:.0%})"
        return None

    def check(self, items: Sequence[tuple[str, str, str, str]]) -> list[str | None]:
        """A reason (or None: accepted) for each (child, parent, answer, teacher prompt)."""
        reasons = [self.text_reason(*item) for item in items]
        alive = [i for i, r in enumerate(reasons) if r is None]
        if alive:
            vecs = self.embed([items[i][0] for i in alive] + [items[i][1] for i in alive])
            for k, i in enumerate(alive):
                sim = float((vecs[k] * vecs[len(alive) + k]).sum())
                if sim < self.bounds.min_similarity:
                    reasons[i] = f"off topic: similarity {sim:.2f} to the parent (min {self.bounds.min_similarity:.2f})"
        alive = [i for i, r in enumerate(reasons) if r is None]
        if alive and self.logprobs is not None:
            lp = self.logprobs([items[i][0] for i in alive] + [items[i][1] for i in alive])
            for k, i in enumerate(alive):
                child_lp, parent_lp = lp[k], lp[len(alive) + k]
                if child_lp < parent_lp - self.bounds.max_logprob_drop:
                    reasons[i] = (f"not language: mean log-prob {child_lp:.2f} under the reference model, the "
                                  f"parent's {parent_lp:.2f} (max drop {self.bounds.max_logprob_drop:g})")
        return reasons
