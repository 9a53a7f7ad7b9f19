"""Refine stage: turn prompts the policy cannot use into children that it can (docs/algorithms.md §3).

The stage is routing over the strategies of tasks/strategies/ (one file each, behind the `Strategy` protocol):
for each scored prompt of the round, in prompt-id order, each enabled strategy in routing order says whether
the prompt takes a slot of its cap (its own, or `promote` for a promotion one step harder) and, if the cap has
room, proposes children. Proposals that need the teacher are asked together after the pass (each answer lands in
`teacher_calls` as it returns: tasks/strategies/teacher_calls.py), then every child is judged (the gate's
checks, and the batched rewrite gate for free-text rewrites: tasks/strategies/gate.py), and the stage commits
`refinements` (one row per attempt, with its reason) and the accepted children in `prompts`, once.

Routing, with the built-in strategies:
- too_hard / flat originals -> the format ladder (enter at mcq4), hint_prefix, teacher_scaffold;
- too_hard reasoning-gym arithmetic originals, and too_hard soften rungs -> soften (one step easier);
- saturated originals from reasoning-gym -> harden (others just go to reserve);
- ladder rungs, hint children and soften rungs whose mean reward exceeds the promotion threshold -> one step
  harder;
- informative prompts are left unchanged.

Choices, and why:
- Routing order is the order of `RefineConfig.strategies`' choices, not of the configured list, which only
  enables: when `max_children` runs out partway through a prompt, the earlier strategy gets the slot, and the
  teacher is asked in the order its calls were proposed (the batch's seed depends on it), so the same enabled
  set always makes the same children. A strategy outside the choices (one registered by a test) comes after.
- Caps: at most `max_per_strategy` children per strategy (promotions count as `promote`) and `max_children` in
  all; a teacher call takes its slot when proposed. A child that is a held-out prompt or a twin of one is
  rejected as `held out`; one already in this run's pool as `duplicate`; one another run made is reused as it
  is (tasks/strategies/ledger.py).
- A teacher call that fails falls back per prompt ("teacher unavailable: <why>" in the row's reason) and the
  round goes on; it is not cached, so a later run asks again. The teacher and how it is asked are the [teacher]
  section (tasks/strategies/teacher_calls.py `TeacherConfig`, shared with shape); what refine asks of it
  (attempts shown, distractors, scaffolds from the policy) stays here. With teacher.model = 'policy',
  teacher_scaffold is skipped unless `scaffolds_from_policy` is set: a 135M policy's rewrites of its own
  failures were never valid questions (0 of 20).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Literal, get_args

import polars as pl
from pydantic import Field

from models.config import ModelConfig, Section
from models.registry import load_model, load_teacher
from storage.rounds import prompts
from storage.store import Store, fault_point
from tasks.core.eps import lope_replaced
from tasks.core.heldout import twin_key
from tasks.stage import RoundContext, skipped, stage
from tasks.strategies import Parent, Proposal, RoundView, strategy
from tasks.strategies.base import Answer
from tasks.strategies.gate import (
    Lengths,
    RewriteBounds,
    RewriteGate,
    check_child,
    mean_logprobs,
)
from tasks.strategies.ledger import Ledger
from tasks.strategies.teacher_calls import Teacher, TeacherConfig, ask_teacher, teacher_cache

StrategyName = Literal["ladder", "soften", "hint_prefix", "teacher_scaffold", "harden"]  # in routing order


class RefineConfig(Section):
    """Refinement of too-hard, flat and saturated prompts into children (docs/algorithms.md §3)."""

    strategies: list[StrategyName] = Field(
        default_factory=lambda: ["ladder", "soften", "teacher_scaffold", "hint_prefix", "harden"],
        description="enabled strategies (each a file under tasks/strategies/); an empty list turns refinement off")
    max_children: int = Field(24, ge=0, le=100_000, description="refinements per round, all strategies")
    max_per_strategy: int = Field(8, ge=0, le=100_000, description="refinements per round and strategy")
    promote_threshold: float = Field(0.5, ge=0.0, le=1.0, description="ladder promotion when mean reward > this "
                                     "(on an mcq rung, corrected for guessing)")
    hint_fraction: float = Field(0.3, gt=0.0, lt=1.0, description="f: share of the solution revealed; each "
                                 "promotion of a hint child lowers it by hint_anneal_step, down to the open question")
    hint_anneal_step: float = Field(0.1, gt=0.0, lt=1.0, description="how much less of the solution a promoted "
                                    "hint child reveals (below 0.05 left: the open question)")
    teacher_attempts: int = Field(4, ge=0, le=64, description="teacher_scaffold: how many of the student's own "
                                  "rollouts (with their rewards) the teacher is shown")
    teacher_distractors: bool = Field(True, description="ask the teacher for multiple-choice distractors "
                                      "(programmatic ones fill the rest)")
    scaffolds_from_policy: bool = Field(False, description="with teacher.model = 'policy', let the policy write "
                                        "teacher_scaffold rewrites too (off: SmolLM2-135M wrote 0 valid ones in "
                                        "20; configure a stronger teacher instead); distractors are still asked")
    gate_min_chars: int = Field(8, ge=0, le=1_000_000, description="a child's text has at least this many "
                                "characters (stripped), else 'too short'")
    gate_max_chars: int = Field(4000, ge=1, le=1_000_000, description="a child's text has at most this many "
                                "characters, else 'too long'")
    gate_min_similarity: float = Field(0.5, ge=-1.0, le=1.0, description="a rewrite's MiniLM cosine similarity "
                                       "to its parent is at least this, else 'off topic'")
    gate_min_word_share: float = Field(0.75, ge=0.0, le=1.0, description="share of a rewrite's words that are "
                                       "dictionary words, at least; else 'not language'")
    gate_min_function_share: float = Field(0.15, ge=0.0, le=1.0, description="share of English function words "
                                           "(the, of, is...) in a rewrite of 5+ words, at least; else 'not language'")
    gate_max_logprob_drop: float = Field(2.0, ge=0.0, le=100.0, description="a rewrite's mean token log-prob "
                                         "under the base policy (version 0) is at most this many nats below its "
                                         "parent's, else 'not language'")

    def scaffolds_run(self, teacher: TeacherConfig) -> bool:
        """Do teacher_scaffold rewrites run with this teacher? They are on, and the teacher is not the policy
        unless scaffolds_from_policy is set (a small policy's rewrites of its own failures are noise)."""
        return "teacher_scaffold" in self.strategies and (not teacher.is_policy or self.scaffolds_from_policy)

    def rewrite_gate(self, logprobs: Callable[[list[str]], list[float]] | None) -> RewriteGate:
        return RewriteGate(RewriteBounds(min_similarity=self.gate_min_similarity,
                                         min_word_share=self.gate_min_word_share,
                                         min_function_share=self.gate_min_function_share,
                                         max_logprob_drop=self.gate_max_logprob_drop,
                                         lengths=Lengths(self.gate_min_chars, self.gate_max_chars)), logprobs=logprobs)


def routing_order(enabled: Sequence[str]) -> list[str]:
    """The enabled strategies in the order each prompt is offered to them: that of the config's choices, then
    any other registered strategy in the order given.

    >>> routing_order(["harden", "teacher_scaffold", "hint_prefix", "ladder"])
    ['ladder', 'hint_prefix', 'teacher_scaffold', 'harden']
    """
    choices = get_args(StrategyName)
    return sorted(enabled, key=lambda name: choices.index(name) if name in choices else len(choices))


def judged(p: Proposal, lengths: Lengths) -> Proposal:
    """`p` with the checks every child passes run, where its maker left them to the stage."""
    if p.gate != "child" or p.child is None or p.reason is not None:
        return p
    return replace(p, reason=check_child(p.child["text"], p.parent["text"], p.child["answer"],
                                         min_chars=lengths.min_chars, max_chars=lengths.max_chars), gate="judged")


@dataclass
class Waiting:
    """A proposal that waits for the teacher or for the batched rewrite gate, and the slot it took."""

    position: int  # its strategy's place in the routing order
    slot: str
    proposal: Proposal
    call: dict | None = None  # the teacher call, as refinements.teacher_call stores it
    asked: str = ""  # what the teacher was asked (the rewrite gate checks the child does not parrot it)


def refine(ctx: RoundContext, store: Store, cfg: RefineConfig, teacher: Teacher | None,
           logprobs: Callable[[list[str]], list[float]] | None = None,
           asking: TeacherConfig | None = None) -> dict:
    """The refine stage of ctx's round with this teacher (None: none), asked as `asking` says (its answer length
    and temperature; default: the [teacher] defaults): reads the round's scores, lands children and refinements.
    `logprobs`: mean token log-probs of texts under the reference model, for the rewrite gate's fluency check
    (None skips that check; the model-free checks and the topic check still run)."""
    if store.landed(ctx.run_id, ctx.round, "refine"):
        return skipped("refine", ctx.round)
    scores = ctx.rows(store, "prompt_scores").select("prompt_id", "bucket", "mean_reward").collect()
    rows = prompts(store).collect()
    by_id = {r["prompt_id"]: r for r in rows.iter_rows(named=True)}
    scored = scores.join(rows.select("prompt_id", "transform"), on="prompt_id").sort("prompt_id")
    parents = [Parent(row, by_id.get(row["root_id"], row), s["bucket"], s["mean_reward"])
               for s in scored.iter_rows(named=True) for row in [by_id[s["prompt_id"]]]]
    # the teacher is shown the student's own attempts: LoPE replacements were sampled under a perturbed
    # prompt and train the policy only (docs/algorithms.md §3)
    rollouts = (ctx.rows(store, "rollouts").filter(~lope_replaced()).sort("prompt_id", "sample_idx")
                .select("prompt_id", "reward", "completion").collect())
    attempts = {k[0]: g.to_dicts() for k, g in rollouts.group_by("prompt_id")}
    pool = ctx.rows(store, "pool").select("prompt_id", "status").collect()
    in_pool = set(pool["prompt_id"])
    held = pool.filter(pl.col("status") == "heldout")["prompt_id"].to_list()
    held_twins = frozenset(twin_key(by_id[i]["text"], by_id[i]["answer"]) for i in held if i in by_id)
    view = RoundView(ctx.run_id, ctx.round, cfg, teacher, attempts)
    ledger = Ledger(cfg.max_per_strategy, cfg.max_children, set(by_id), in_pool, held_twins)

    waiting = offer(parents, view, ledger)
    fresh, unavailable = answer(store, view, waiting, asking or TeacherConfig())
    fault_point("refine:mid")  # test hook: a fault test kills the process here, teacher calls landed, refine not
    judge_rewrites(waiting, cfg.rewrite_gate(logprobs))
    for w in sorted(waiting, key=lambda w: w.position):  # each strategy's in turn, in the order proposed
        ledger.take(w.slot, -1)
        ledger.record(w.slot, judged(w.proposal, view.lengths), w.call)
    store.commit("refine", ledger.tables(ctx.run_id, ctx.round), run_id=ctx.run_id, round=ctx.round)
    return {"stage": "refine", "round": ctx.round, **ledger.summary(),
            "teacher_calls": len(fresh),  # answers asked for and received now (a failed call is teacher_unavailable)
            "teacher_unavailable": len(unavailable)}  # prompts, not calls: a prompt can have two failed calls


def offer(parents: list[Parent], view: RoundView, ledger: Ledger) -> list[Waiting]:
    """Offer each parent to each enabled strategy in routing order, while its cap has room; record what is made
    now, and return what waits for the teacher or the rewrite gate (its slot taken)."""
    waiting: list[Waiting] = []
    order = routing_order(view.cfg.strategies)
    for parent in parents:
        for position, name in enumerate(order):
            slot = strategy(name).slot(parent, view)
            if slot is None or not ledger.room(slot):
                continue
            for p in strategy(name).propose(parent, view):
                if p.ask is not None or p.gate == "rewrite":
                    ledger.take(slot)
                    waiting.append(Waiting(position, slot, p))
                else:
                    ledger.record(slot, judged(p, view.lengths))
    return waiting


def answer(store: Store, view: RoundView, waiting: list[Waiting], asking: TeacherConfig) -> tuple[set[str], set[str]]:
    """Ask the teacher every call the waiting proposals need (the store answers those asked before), and make
    each proposal from its answer. Returns (keys answered now, parent ids some call of which failed)."""
    asks = [w for w in waiting if w.proposal.ask is not None]
    payloads = {w.proposal.ask.key: w.proposal.ask.payload for w in asks}
    if not payloads:
        return set(), set()
    if view.teacher is None:
        raise ValueError(f"strategy {asks[0].slot!r} asked the teacher, but none is loaded: its wants_teacher must "
                         "say so")
    cache = teacher_cache(store)
    fresh, failed = ask_teacher(store, view.teacher, payloads, cache, asking.max_new_tokens, asking.temperature)
    unavailable: set[str] = set()
    for w in asks:
        ask = w.proposal.ask
        reply = Answer(ask.key, view.teacher.name, None if ask.key in failed else cache[ask.key],
                       failed.get(ask.key), ask.key not in fresh)
        if reply.error is not None:
            unavailable.add(w.proposal.parent["prompt_id"])
        w.proposal, w.call, w.asked = ask.then(reply), reply.record(), ask.payload
    return fresh, unavailable


def judge_rewrites(waiting: list[Waiting], gate: RewriteGate) -> None:
    """The rewrite gate's verdict on every free-text rewrite of the round, at once (one MiniLM call, one
    reference scoring call)."""
    rewrites = [w for w in waiting if w.proposal.gate == "rewrite" and w.proposal.child and w.proposal.reason is None]
    verdicts = gate.check([(w.proposal.child["text"], w.proposal.parent["text"], w.proposal.parent["answer"], w.asked)
                           for w in rewrites])
    for w, verdict in zip(rewrites, verdicts):
        w.proposal = replace(w.proposal, reason=verdict, gate="judged")


@stage("refine")
def refine_task(ctx: RoundContext, store: Store, cfg: RefineConfig, teacher_cfg: TeacherConfig) -> dict:
    """The refine stage as the flow runs it: loads the teacher (`teacher_cfg`, the [teacher] section) if an
    enabled strategy asks one, and the run's base policy as the rewrite gate's reference model (only if a
    rewrite gets that far)."""
    ran = running(cfg, teacher_cfg)
    self_taught = ran.strategies != cfg.strategies  # teacher_scaffold left out
    cfg = ran
    teacher = load_teacher(teacher_cfg.model, ctx.model, teacher_cfg) if wants_a_teacher(cfg) else None
    reference = ctx.model.model_copy(update={"policy": reference_policy(store, ctx.run_id, ctx.policy),
                                             "backend": "transformers"})
    out = refine(ctx, store, cfg, teacher, logprobs=partial(reference_logprobs, reference), asking=teacher_cfg)
    if self_taught:
        out["teacher_scaffold"] = ("off: the teacher is the policy (set teacher.model, or "
                                   "refine.scaffolds_from_policy = true)")
    return out


def reference_logprobs(reference: ModelConfig, texts: list[str]) -> list[float]:
    """Mean token log-probs of `texts` under the reference model, loaded on first use."""
    return mean_logprobs(load_model(reference), texts)


def running(cfg: RefineConfig, teacher_cfg: TeacherConfig) -> RefineConfig:
    """`cfg` with the strategies the stage runs: teacher_scaffold is skipped until a teacher other than the
    policy is set (or refine.scaffolds_from_policy)."""
    if "teacher_scaffold" in cfg.strategies and not cfg.scaffolds_run(teacher_cfg):
        return cfg.model_copy(update={"strategies": [s for s in cfg.strategies if s != "teacher_scaffold"]})
    return cfg


def wants_a_teacher(cfg: RefineConfig) -> bool:
    """Does some strategy the stage runs (`running`'s) ask the teacher?"""
    return any(strategy(name).wants_teacher(cfg) for name in cfg.strategies)


def asks_the_policy(cfg: RefineConfig, teacher_cfg: TeacherConfig) -> bool:
    """Does the stage load the round's policy weights (a strategy that wants the teacher, and the teacher is the
    policy)? The gate's reference model is the base policy, never pruned."""
    return teacher_cfg.model == "policy" and wants_a_teacher(running(cfg, teacher_cfg))


def reference_policy(store: Store, run_id: str, round_policy: str) -> str:
    """The run's base policy (version 0), the gate's reference model: its recorded checkpoint row once the
    first train stage landed, else the round's policy, which is the base until then."""
    from storage.checkpoints import checkpoint_versions

    v0 = checkpoint_versions(store, run_id).filter(pl.col("policy_version") == 0)
    return v0["path"][0] if v0.height else round_policy
