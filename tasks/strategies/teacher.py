"""teacher_scaffold (docs/algorithms.md §3.3): a teacher rewrites a too-hard or flat original so that it keeps the
task and the answer but helps the student, shown the student's own attempts.

The teacher sees the problem, the first `refine.teacher_attempts` of the policy's own rollouts with their
rewards (each cut to ATTEMPT_CHARS characters; LoPE replacements were sampled under a perturbed prompt and are
not the student's, so the stage leaves them out) and the reference answer, which it must not reveal. Its
answer is the child's text, judged by the full gate including the rewrite checks (`gate = "rewrite"`). A call
that failed is recorded as `teacher unavailable: <why>`, an empty answer as `empty answer`; neither is a gate
verdict. The stage runs it only where a teacher other than the policy is configured, or
`refine.scaffolds_from_policy` is set (`RefineConfig.scaffolds_run`).
"""

from __future__ import annotations

from functools import partial

from tasks.strategies.base import Answer, Ask, Parent, Proposal, RoundView, Settings, Strategy, register
from tasks.strategies.gate import EMPTY_ANSWER, UNAVAILABLE
from tasks.strategies.teacher_calls import call_key

ATTEMPT_CHARS = 300  # each attempt shown to the teacher is cut to this many characters

TEACHER_TEMPLATE = """You are helping a student who keeps failing this problem.

Problem:
{question}

The student's attempts and their rewards (1 = correct):
{attempts}

Reference answer (never reveal it): {answer}

Rewrite the problem so that it keeps the same task and the same answer, but helps the student: add a
missing constraint, split it into sub-goals, or point at the mistake in the attempts. Do not state or hint
at the answer itself. Reply with the rewritten problem only."""


def teacher_payload(parent: dict, rollouts: list[dict], teacher_name: str, shown: int = 4) -> tuple[str, str]:
    """(cache key, prompt text) of a teacher_scaffold call for `parent`, showing its first `shown` rollouts."""
    attempts = "\n".join(f"- reward {r['reward']:.2f}: {r['completion'][:ATTEMPT_CHARS]!r}" for r in rollouts[:shown])
    payload = TEACHER_TEMPLATE.format(question=parent["text"], attempts=attempts, answer=parent["answer"])
    return call_key(teacher_name, payload), payload


@register
class TeacherScaffold(Strategy):
    name = "teacher_scaffold"
    buckets = frozenset({"too_hard", "flat"})

    def slot(self, parent: Parent, view: RoundView) -> str | None:
        return super().slot(parent, view) if view.teacher is not None else None

    def wants_teacher(self, cfg: Settings) -> bool:
        return True

    def propose(self, parent: Parent, view: RoundView) -> list[Proposal]:
        key, payload = teacher_payload(parent.row, list(view.attempts.get(parent.id, [])), view.teacher.name,
                                       view.cfg.teacher_attempts)
        return [Proposal(parent.row, ask=Ask(key, payload, partial(self.rewrite, parent.row, view)))]

    def rewrite(self, parent: dict, view: RoundView, answer: Answer) -> Proposal:
        """The teacher's answer as a child for the rewrite gate, or why there is none."""
        if answer.error is not None:
            return Proposal(parent, reason=f"{UNAVAILABLE}: {answer.error}", gate="judged")
        if not answer.response:
            return Proposal(parent, reason=f"{EMPTY_ANSWER}: the teacher returned nothing", gate="judged")
        return Proposal(parent, view.child(parent, answer.response, self.name), gate="rewrite")
