"""The format ladder (Cog-DRIFT, arXiv 2604.04767; docs/algorithms.md §3): mcq4 < mcq10 < cloze < open.

A too-hard open prompt enters at mcq4. When a variant's mean reward exceeds the promotion threshold in a
round, its lineage moves one step harder: the next variant becomes active and the easier one is retired;
promotion from cloze re-opens the original question. Numeric distractors are made programmatically (near
misses, digit swaps, results of a wrong operation) and, when a teacher is configured, by the teacher
(`distractor_payload`, `parse_distractors`; its answers come first, topped up by programmatic ones); none
may verify as correct (checked here and again by the gate). The correct letter cycles
over positions across the pool (by a hash of the prompt id), so no position is favoured. A letter stands for
its option's value only on an mcq rung (`tasks.core.rewards.mcq_options`, read by the verifier); a cloze rung's answer is the
value. The cloze pattern masks a count of digits drawn uniformly from those that keep 50-80% masked and at
least one digit shown.

The `ladder` strategy (`Ladder`): a too-hard or flat original enters at mcq4 (strategy `ladder`); a rung whose
mean reward exceeds `refine.promote_threshold` is promoted to the next rung (strategy `promote`), made from the
root's question as a child of the rung; promotion from cloze, or from mcq10 when the answer has under two digits,
re-opens the root question. On an mcq rung of k options the mean reward is first corrected for guessing
(`chance_corrected`: (r - 1/k) / (1 - 1/k), clipped at 0; issue 50), so a rung answered a little above chance
does not clear the threshold by luck: at 0.5, mcq4 needs a raw mean above 0.625 and mcq10 above 0.55. The
correction applies to the group's mean, not per sample: with 0/1 rewards a per-sample correction clipped at 0
is the raw reward. A multiple-choice rung waits for the teacher's distractors when
`refine.teacher_distractors` is set and a teacher is configured; a failed call falls back to programmatic ones,
and the row's reason says so.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import replace
from functools import partial

from tasks.core.answers import exact_match
from tasks.core.ids import seed_of
from tasks.core.rewards import LETTERS
from tasks.strategies.base import (
    PROMOTE,
    Answer,
    Ask,
    Parent,
    Proposal,
    RoundView,
    Settings,
    Strategy,
    child_row,
    register,
)
from tasks.strategies.gate import LENGTHS, UNAVAILABLE, Lengths, check_child, cloze_mask_counts
from tasks.strategies.teacher_calls import call_key

LEVELS = ("mcq4", "mcq10", "cloze", "open")


def next_level(level: str) -> str | None:
    i = LEVELS.index(level)
    return LEVELS[i + 1] if i + 1 < len(LEVELS) else None


def _seed(*parts: str) -> int:
    return seed_of("\x1f".join(parts))


def numeric_distractors(answer: str, question: str, k: int, seed: int) -> list[str]:
    """k distinct wrong numeric answers that look plausible, or [] if the answer is not an integer."""
    try:
        a = int(answer.strip())
    except ValueError:
        return []
    rng = random.Random(seed)
    nums = [int(x) for x in re.findall(r"-?\d+", question)][:6]
    cands: list[int] = [a + d for d in (1, -1, 2, -2, 10, -10)]  # near misses
    s = str(abs(a))
    if len(s) > 1:  # digit swaps
        cands += [int(("-" if a < 0 else "") + s[::-1])] + [
            int(("-" if a < 0 else "") + s[:i] + s[i + 1] + s[i] + s[i + 2 :]) for i in range(len(s) - 1)]
    for i, x in enumerate(nums):  # a wrong operation on the question's numbers
        for y in nums[i + 1 :]:
            cands += [x + y, x - y, y - x, x * y]
    cands += [a + rng.randint(-20, 20) for _ in range(40)] + [-a, a * 2]
    out: list[str] = []
    for c in cands:
        sc = str(c)
        if c != a and sc not in out and not exact_match(sc, answer):
            out.append(sc)
    rng.shuffle(out)
    near = [o for o in out if abs(int(o) - a) <= max(10, abs(a))]
    far = [o for o in out if o not in near]
    return (near + far)[:k]


DISTRACTOR_TEMPLATE = """Write {k} wrong answers to this problem that a student could plausibly give, for
example from a common slip. Each must differ from the correct answer. One per line, the answer only.

Problem:
{question}

Correct answer: {answer}"""


def distractor_payload(question: str, answer: str, k: int, teacher_name: str) -> tuple[str, str]:
    """(cache key, prompt text) of a teacher call for k distractors."""
    payload = DISTRACTOR_TEMPLATE.format(k=k, question=question, answer=answer.strip())
    return call_key(teacher_name, f"distractors\x1f{payload}"), payload


def parse_distractors(response: str, answer: str, k: int) -> list[str]:
    """Up to k distinct usable distractors from a teacher's reply. For an integer answer only integers count;
    anything equal to the answer (as text or as a number) is dropped.

    >>> parse_distractors("1. 54\\n- 56\\n(C) 65\\nfifty\\n54\\n-7", "56", 3)
    ['54', '65', '-7']
    """
    numeric = re.fullmatch(r"-?\d+", answer.strip()) is not None
    out: list[str] = []
    for line in response.splitlines():
        item = re.sub(r"^\s*(?:[-*\u2022]\s+|\(?[A-Ja-j0-9]{1,2}[.):]\s+)", "", line).strip().rstrip(".")
        if numeric:
            m = re.fullmatch(r"(-?\d+)", item)
            if not m:
                continue
            item = str(int(m.group(1)))
        elif not item or len(item) > 40:
            continue
        if item not in out and not exact_match(item, answer):
            out.append(item)
        if len(out) == k:
            break
    return out


def make_mcq(prompt_id: str, question: str, answer: str, n_options: int,
             preferred: list[str] = ()) -> tuple[str, list[str], int] | None:
    """(child text, options, index of the correct one), or None when no distractors can be made.
    `preferred` distractors (the teacher's) come first; programmatic ones fill the rest."""
    wrong = [w for w in preferred if not exact_match(w, answer)][: n_options - 1]
    for w in numeric_distractors(answer, question, n_options - 1, _seed(prompt_id, str(n_options))):
        if len(wrong) < n_options - 1 and w not in wrong:
            wrong.append(w)
    if len(wrong) < n_options - 1:
        return None
    correct = _seed(prompt_id, "letter") % n_options  # balanced over positions across the pool
    options = wrong[:correct] + [answer.strip()] + wrong[correct:]
    listing = "\n".join(f"({LETTERS[i]}) {o}" for i, o in enumerate(options))
    text = (f"{question}\nOptions:\n{listing}\n"
            "Choose the correct option and give its value as your final answer.")
    return text, options, correct


def make_cloze(prompt_id: str, question: str, answer: str) -> str | None:
    """The question with a partly masked answer pattern: 50-80% of the answer's digits become '_', at least
    one digit stays."""
    a = answer.strip()
    digits = [i for i, ch in enumerate(a) if ch.isdigit()]
    if len(digits) < 2:
        return None
    rng = random.Random(_seed(prompt_id, "cloze"))
    n = len(digits)
    # uniform over the admissible counts, the gate's own rule (never empty, never all n for n >= 2): rounding a
    # uniform share instead reached 5 of 6 and 6 of 7 digits, above the 80% ceiling
    counts = cloze_mask_counts(n)
    n_mask = rng.randint(counts.start, counts.stop - 1)
    masked = set(rng.sample(digits, n_mask))
    pattern = "".join("_" if i in masked else ch for i, ch in enumerate(a))
    return f"{question}\nThe answer should look like: {pattern}"


def n_options(level: str) -> int:
    return 4 if level == "mcq4" else 10


def chance_corrected(rate: float, k: int) -> float:
    """A pass rate on k options corrected for guessing: (r - 1/k) / (1 - 1/k), clipped at 0 (0 at chance, 1 at 1).

    >>> chance_corrected(0.25, 4), chance_corrected(0.75, 4), chance_corrected(1.0, 10), chance_corrected(0.05, 10)
    (0.0, 0.6666666666666666, 1.0, 0.0)
    """
    return max(0.0, (rate - 1 / k) / (1 - 1 / k))


def promotion_rate(parent: Parent) -> float:
    """The mean reward a rung's promotion is decided on: corrected for guessing on an mcq rung (k = its stored
    options, else the rung's size), as it is elsewhere."""
    if not parent.transform.startswith("mcq"):
        return parent.mean_reward
    options = json.loads(parent.row.get("meta") or "{}").get("options")
    return chance_corrected(parent.mean_reward, len(options) if options else n_options(parent.transform))


def ladder_child(parent: dict, root: dict, level: str, run_id: str, round: int,
                 teacher_distractors: list[str] = (), lengths: Lengths = LENGTHS) -> tuple[dict | None, str | None]:
    """The `level` rung of `root`'s question, made a child of `parent`. (child, rejection reason). Its meta is
    the root's plus the rung's own keys, never the parent rung's: a cloze child of an mcq10 rung that kept its
    options would score a bare letter as the value. Every rung passes the gate (length bounds and leaks; the
    options of an mcq rung, the pattern of a cloze)."""
    q, a = root["text"], root["answer"]
    bounds = {"min_chars": lengths.min_chars, "max_chars": lengths.max_chars}
    if level.startswith("mcq"):
        made = make_mcq(root["prompt_id"], q, a, n_options(level), list(teacher_distractors))
        if made is None:
            return None, f"unsupported: {level} needs numeric distractors; answer {a!r} has none"
        text, options, correct = made
        reason = check_child(text, q, a, kind="mcq", options=options, correct=correct, **bounds)
        by_teacher = sum(o in teacher_distractors for i, o in enumerate(options) if i != correct)
        return child_row(parent, text, level, run_id, round, {"level": level, "options": options,
                                                              "teacher_distractors": by_teacher},
                         meta_from=root), reason
    if level == "cloze":
        text = make_cloze(root["prompt_id"], q, a)
        if text is None:
            return None, "unsupported: cloze needs an answer of 2+ digits to mask"
        return (child_row(parent, text, "cloze", run_id, round, {"level": "cloze"}, meta_from=root),
                check_child(text, q, a, kind="cloze", **bounds))
    raise ValueError(f"not a ladder rung: {level}")


@register
class Ladder(Strategy):
    name = "ladder"
    buckets = frozenset({"too_hard", "flat"})

    def slot(self, parent: Parent, view: RoundView) -> str | None:
        if parent.transform in LEVELS:
            return PROMOTE if view.solved(replace(parent, mean_reward=promotion_rate(parent))) else None
        return super().slot(parent, view)

    def wants_teacher(self, cfg: Settings) -> bool:
        return cfg.teacher_distractors

    def propose(self, parent: Parent, view: RoundView) -> list[Proposal]:
        if parent.transform not in LEVELS:
            return [self.rung(parent.row, parent.row, "mcq4", view)]
        root = parent.root
        up = next_level(parent.transform)
        if up == "cloze" and make_cloze(root["prompt_id"], root["text"], root["answer"]) is None:
            up = "open"  # a one-digit answer cannot be a cloze pattern
        if up == "open":
            return [Proposal(parent.row, root, gate="judged")]
        return [self.rung(parent.row, root, up, view)]

    def rung(self, parent: dict, root: dict, level: str, view: RoundView) -> Proposal:
        """The `level` rung, at once, or once the teacher's distractors are in."""
        if view.teacher is None or not view.cfg.teacher_distractors or not level.startswith("mcq"):
            return Proposal(parent, *ladder_child(parent, root, level, view.run_id, view.round,
                                                  lengths=view.lengths), gate="judged")
        key, payload = distractor_payload(root["text"], root["answer"], n_options(level) - 1, view.teacher.name)
        return Proposal(parent, ask=Ask(key, payload, partial(self.with_distractors, parent, root, level, view)))

    def with_distractors(self, parent: dict, root: dict, level: str, view: RoundView, answer: Answer) -> Proposal:
        """The rung with the teacher's distractors first (programmatic ones fill the rest, or all of them when
        the call failed)."""
        wrong = [] if answer.error is not None else parse_distractors(answer.response, root["answer"],
                                                                      n_options(level) - 1)
        child, reason = ladder_child(parent, root, level, view.run_id, view.round, wrong, view.lengths)
        note = f"{UNAVAILABLE}: {answer.error}; programmatic distractors" if answer.error is not None else None
        return Proposal(parent, child, reason, gate="judged", note=note)
