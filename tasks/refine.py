"""Refine stage: turn prompts the policy cannot use into children that it can (docs/algorithms.md §3).

Routing, per the round's scores:
- too_hard / flat originals -> the format ladder (enter at mcq4), teacher_scaffold, hint_prefix;
- saturated originals from reasoning-gym -> harden (one difficulty step up; others just go to reserve);
- ladder variants whose mean reward exceeds the promotion threshold -> the next, harder rung
  (mcq4 -> mcq10 -> cloze -> open); the easier variant is retired. Distractors come from the teacher
  when one is configured (`teacher_distractors`), topped up programmatically;
- hint_prefix children above the threshold are promoted the same way, with the revealed share annealed
  f -> f - 0.1 -> ... -> the open question;
- informative prompts are left unchanged.
Every child passes the validity gate (tasks/strategies/gate.py); rejected children are recorded with their reason in
`refinements` and never enter `prompts`. Teacher calls are keyed on a hash of their payload; each answer
lands in `teacher_calls` as soon as it returns (and is referenced from `refinements.teacher_call`), so a
rerun, even after a crash mid-refine, reuses it instead of calling the teacher again. A payload the teacher
cannot answer (an endpoint down, slow, rate-limited past its retries, or answering garbage) falls back per
prompt: the ladder uses programmatic distractors, a scaffold is not made, and the row's reason says
"teacher unavailable: <why>"; the round goes on, and the failure is not cached, so a later run asks again.
Caps: at most `max_per_strategy` children per strategy and `max_children` in all, per round.
A teacher_scaffold rewrite also passes the rewrite gate (tasks/strategies/gate.py: keeps the parent's quantities, reads
as language, stays on topic, parrots nothing of the teacher's prompt); every rejection reason leads with a
stable category. With teacher = 'policy', scaffolds are skipped unless `scaffolds_from_policy` is set: a
135M policy's rewrites of its own failures were never valid questions (0 of 20).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Literal

import polars as pl
import pyarrow as pa
from prefect import task
from pydantic import Field

from models.backend import Sampling
from models.config import Section
from storage.query import scan
from storage.store import Store, fault_point
from tasks.core.ids import prompt_id as content_id
from tasks.reporting import timed
from tasks.strategies.gate import (
    EMPTY_ANSWER,
    NOT_JUDGED,
    UNAVAILABLE,
    RewriteBounds,
    RewriteGate,
    check_child,
    mean_logprobs,
    reason_category,
)
from tasks.strategies.ladder import LEVELS, distractor_payload, make_cloze, make_mcq, next_level, parse_distractors
from tasks.utility import lope_replaced


class RefineConfig(Section):
    """Refinement of too-hard, flat and saturated prompts into children (docs/algorithms.md §3)."""

    strategies: list[Literal["ladder", "teacher_scaffold", "hint_prefix", "harden"]] = Field(
        default_factory=lambda: ["ladder", "teacher_scaffold", "hint_prefix", "harden"],
        description="enabled strategies; an empty list turns refinement off")
    max_children: int = Field(24, ge=0, le=100_000, description="refinements per round, all strategies")
    max_per_strategy: int = Field(8, ge=0, le=100_000, description="refinements per round and strategy")
    promote_threshold: float = Field(0.5, ge=0.0, le=1.0, description="ladder promotion when mean reward > this")
    hint_fraction: float = Field(0.3, gt=0.0, lt=1.0, description="f: share of the solution revealed; each "
                                 "promotion of a hint child lowers it by 0.1, down to the open question")
    teacher: str = Field("policy", description="'policy', `openai:<base url>#<model>`, or a model spec")
    teacher_max_new_tokens: int = Field(128, ge=8, le=4096, description="longest teacher answer, in tokens")
    teacher_distractors: bool = Field(True, description="ask the teacher for multiple-choice distractors "
                                      "(programmatic ones fill the rest)")
    teacher_timeout_s: float = Field(60.0, gt=0.0, le=3600.0, description="openai teacher: seconds to connect and "
                                     "to wait for each reply's bytes, per request; also caps a 429's Retry-After")
    teacher_retries: int = Field(3, ge=0, le=20, description="openai teacher: retries of a request after a "
                                 "connection error, timeout, 429 or 5xx; then that prompt falls back "
                                 "('teacher unavailable: ...' in refinements) and the round goes on")
    teacher_backoff_s: float = Field(1.0, ge=0.0, le=600.0, description="openai teacher: wait before the first "
                                     "retry, doubled for each next one (a 429's Retry-After replaces it)")
    teacher_concurrency: int = Field(4, ge=1, le=256, description="openai teacher: requests in flight at once")
    scaffolds_from_policy: bool = Field(False, description="with teacher = 'policy', let the policy write "
                                        "teacher_scaffold rewrites too (off: SmolLM2-135M wrote 0 valid ones in "
                                        "20; configure a stronger teacher instead); distractors are still asked")
    gate_min_similarity: float = Field(0.5, ge=-1.0, le=1.0, description="a rewrite's MiniLM cosine similarity "
                                       "to its parent is at least this, else 'off topic'")
    gate_min_word_share: float = Field(0.75, ge=0.0, le=1.0, description="share of a rewrite's words that are "
                                       "dictionary words, at least; else 'not language'")
    gate_min_function_share: float = Field(0.15, ge=0.0, le=1.0, description="share of English function words "
                                           "(the, of, is...) in a rewrite of 5+ words, at least; else 'not language'")
    gate_max_logprob_drop: float = Field(2.0, ge=0.0, le=100.0, description="a rewrite's mean token log-prob "
                                         "under the base policy (version 0) is at most this many nats below its "
                                         "parent's, else 'not language'")

    def scaffolds_run(self) -> bool:
        """Do teacher_scaffold rewrites run? They are on, and the teacher is not the policy unless
        scaffolds_from_policy is set (a small policy's rewrites of its own failures are noise)."""
        return "teacher_scaffold" in self.strategies and (self.teacher != "policy" or self.scaffolds_from_policy)

TEACHER_TEMPLATE = """You are helping a student who keeps failing this problem.

Problem:
{question}

The student's attempts and their rewards (1 = correct):
{attempts}

Reference answer (never reveal it): {answer}

Rewrite the problem so that it keeps the same task and the same answer, but helps the student: add a
missing constraint, split it into sub-goals, or point at the mistake in the attempts. Do not state or hint
at the answer itself. Reply with the rewritten problem only."""


def _child(parent: dict, text: str, transform: str, run_id: str, round: int, meta_extra: dict | None = None,
           answer: str | None = None, params: str | None = None, meta_from: dict | None = None) -> dict:
    """A child row of `parent`. Its meta is `meta_from`'s (default: the parent's) updated by `meta_extra`."""
    answer = parent["answer"] if answer is None else answer
    base = parent if meta_from is None else meta_from
    meta = json.loads(base["meta"]) if base.get("meta") else {}
    meta.update(meta_extra or {})
    return {"prompt_id": content_id(text, answer, parent["source"]), "text": text, "answer": answer,
            "solution": None if answer != parent["answer"] else parent.get("solution"),
            "source": parent["source"], "params": params or parent.get("params"), "parent_id": parent["prompt_id"],
            "root_id": parent["root_id"], "transform": transform, "run_id": run_id, "round": round,
            "meta": json.dumps(meta, sort_keys=True)}


def ladder_child(parent: dict, root: dict, level: str, run_id: str, round: int,
                 teacher_distractors: list[str] = ()) -> tuple[dict | None, str | None]:
    """The `level` rung of `root`'s question, made a child of `parent`. (child, rejection reason). Its meta is
    the root's plus the rung's own keys, never the parent rung's: a cloze child of an mcq10 rung that kept its
    options would score a bare letter as the value. Every rung passes the gate (length bounds and leaks; the
    options of an mcq rung, the pattern of a cloze)."""
    q, a = root["text"], root["answer"]
    if level.startswith("mcq"):
        made = make_mcq(root["prompt_id"], q, a, n_options(level), list(teacher_distractors))
        if made is None:
            return None, f"unsupported: {level} needs numeric distractors; answer {a!r} has none"
        text, options, correct = made
        reason = check_child(text, q, a, kind="mcq", options=options, correct=correct)
        by_teacher = sum(o in teacher_distractors for i, o in enumerate(options) if i != correct)
        return _child(parent, text, level, run_id, round, {"level": level, "options": options,
                                                           "teacher_distractors": by_teacher},
                      meta_from=root), reason
    if level == "cloze":
        text = make_cloze(root["prompt_id"], q, a)
        if text is None:
            return None, "unsupported: cloze needs an answer of 2+ digits to mask"
        return (_child(parent, text, "cloze", run_id, round, {"level": "cloze"}, meta_from=root),
                check_child(text, q, a, kind="cloze"))
    raise ValueError(f"not a ladder rung: {level}")


def n_options(level: str) -> int:
    return 4 if level == "mcq4" else 10


def hint_child(parent: dict, fraction: float, run_id: str, round: int,
               root: dict | None = None) -> tuple[dict | None, str | None]:
    """hint_prefix: reveal the first `fraction` of the root's reference solution's words as a started answer.
    `parent` is the root itself, or (annealing) the hint child it replaces."""
    root = root or parent
    sol = root.get("solution")
    if not sol:
        return None, "unsupported: hint_prefix needs a reference solution"
    words = sol.split()
    k = max(1, int(len(words) * fraction))
    text = f"{root['text']}\nA solution starts like this: {' '.join(words[:k])} ..."
    child = _child(parent, text, "hint_prefix", run_id, round, {"hint_fraction": fraction})
    child["solution"] = root.get("solution")
    return child, check_child(text, root["text"], root["answer"])


def annealed_fraction(fraction: float, step: float = 0.1) -> float:
    """The next hint fraction after a promotion: f - 0.1, and 0 (the open question) once nothing is left.

    >>> annealed_fraction(0.3), annealed_fraction(0.1), annealed_fraction(0.05)
    (0.2, 0.0, 0.0)
    """
    nxt = round(fraction - step, 6)
    return nxt if nxt >= 0.05 else 0.0


def harden_child(parent: dict, run_id: str, round: int) -> tuple[dict | None, str | None]:
    """A sibling problem one reasoning-gym difficulty step up (a new problem, so a new answer)."""
    if not parent["source"].startswith("rg:"):
        return None, "unsupported: harden needs an rg: source"
    from tasks.core.sources import rg_config_fields, rg_rows

    task_name = parent["source"][3:]
    params = json.loads(parent["params"] or "{}")
    fields = rg_config_fields(task_name)
    key = next((k for k in ("max_digits", "max_terms") if k in fields), None)
    if key is None:
        return None, f"unsupported: harden needs max_digits/max_terms, which rg:{task_name} lacks"
    gen = {k: v for k, v in params.items() if k in fields}
    gen[key] = int(gen.get(key, fields[key])) + 1
    seed = int(hashlib.sha256(parent["prompt_id"].encode()).hexdigest()[:7], 16)
    row = rg_rows(task_name, 1, seed, gen)[0]
    return _child(parent, row.text, "harden", run_id, round, json.loads(row.meta), answer=row.answer,
                  params=row.params), None


def teacher_payload(parent: dict, rollouts: list[dict], teacher: Any) -> tuple[str, str]:
    """(cache key, prompt text) of a teacher_scaffold call for `parent`."""
    attempts = "\n".join(f"- reward {r['reward']:.2f}: {r['completion'][:300]!r}" for r in rollouts[:4])
    payload = TEACHER_TEMPLATE.format(question=parent["text"], attempts=attempts, answer=parent["answer"])
    key = hashlib.sha256(f"{getattr(teacher, 'name', 'teacher')}\x1f{payload}".encode()).hexdigest()[:24]
    return key, payload


LAND_EVERY_S = 2.0  # answers that returned within this long land as one commit: a commit per answer would
                   # cost a Parquet file and a commit record each, for no safety a crash could notice


def ask_teacher(store: Store, teacher: Any, payloads: dict[str, str], cache: dict,
                max_new_tokens: int) -> tuple[set[str], dict[str, str]]:
    """Ask the teacher every payload not in `cache`; returns (keys answered now, {key: one-line reason} of the
    payloads it could not answer).

    Answers land in `teacher_calls` as they return, not after the whole batch: an endpoint teacher (one with
    `ask`) answers concurrently and whatever returned lands every LAND_EVERY_S; a local model answers in
    batches of its batch size (one generate call each, its efficient unit), each landing when it returns. So
    a crash costs at most the answers of those last seconds or that last batch, and a rerun never pays twice.
    Failures are not cached: a later stage or run asks again."""
    missing = [k for k in payloads if k not in cache]
    fresh: set[str] = set()
    failed: dict[str, str] = {}
    if not missing:
        return fresh, failed
    name = getattr(teacher, "name", "teacher")
    returned: list[tuple[str, str]] = []
    last_landed = time.monotonic()

    def land() -> None:
        nonlocal last_landed
        if returned:
            keys = [k for k, _ in returned]
            digest = hashlib.sha256("".join(keys).encode()).hexdigest()[:16]
            store.commit(f"teacher-{digest}", {"teacher_calls": pa.table({
                "key": keys, "teacher": [name] * len(keys), "response": [r for _, r in returned],
                "created_at": [datetime.now(UTC)] * len(keys)})})
            cache.update(returned)
            fresh.update(keys)
            returned.clear()
        last_landed = time.monotonic()

    def on_answer(key: str, text: str | None, error: str | None) -> None:
        if error is not None:
            failed[key] = error
        else:
            returned.append((key, text.strip()))
        if time.monotonic() - last_landed >= LAND_EVERY_S:
            land()

    def collect_answer(key: str, text: str) -> None:  # a local batch lands whole: no commit split by timing
        returned.append((key, text.strip()))

    def messages(key: str) -> list[dict]:
        return [{"role": "user", "content": payloads[key]}]

    def sampling(keys: list[str]) -> Sampling:  # seeded by the keys asked together: a rerun asks the same
        return Sampling(0.7, 1.0, max_new_tokens, int(hashlib.sha256("".join(keys).encode()).hexdigest()[:7], 16))

    if hasattr(teacher, "ask"):
        teacher.ask({k: (messages(k), sampling([k])) for k in missing}, on_answer)
    else:
        step = max(1, int(getattr(teacher, "batch_size", 0) or len(missing)))
        for i in range(0, len(missing), step):
            batch = missing[i : i + step]
            groups = teacher.generate([teacher.render(messages(k)) for k in batch], 1, sampling(batch))
            for k, g in zip(batch, groups):
                collect_answer(k, g[0].text)
            land()
    land()
    return fresh, failed


def teacher_cache(store: Store) -> dict:
    """Every stored teacher answer, by payload hash."""
    calls = scan(store, "teacher_calls").select("key", "response").unique("key").collect()
    return dict(calls.iter_rows())


def refine(store: Store, run_id: str, round: int, cfg: Any, teacher: Any | None,
           logprobs: Callable[[list[str]], list[float]] | None = None) -> dict:
    """The refine stage of (run_id, round): reads the round's scores, lands children and refinements.
    `logprobs`: mean token log-probs of texts under the reference model, for the rewrite gate's fluency
    check (None skips that check; the model-free checks and the topic check still run)."""
    if store.landed(run_id, round, "refine"):
        return {"stage": "refine", "round": round, "skipped": "already landed"}
    this = (pl.col("run_id") == run_id) & (pl.col("round") == round)
    scores = scan(store, "prompt_scores").filter(this).select("prompt_id", "bucket", "mean_reward").collect()
    prompts = scan(store, "prompts").unique("prompt_id").collect()
    by_id = {r["prompt_id"]: r for r in prompts.iter_rows(named=True)}
    scored = scores.join(prompts.select("prompt_id", "transform"), on="prompt_id").sort("prompt_id")
    # the teacher is shown the student's own attempts: LoPE replacements were sampled under a perturbed
    # prompt and train the policy only (docs/algorithms.md §3)
    rollouts = (scan(store, "rollouts").filter(this & ~lope_replaced()).sort("prompt_id", "sample_idx")
                .select("prompt_id", "reward", "completion").collect())
    groups = {k[0]: g.to_dicts() for k, g in rollouts.group_by("prompt_id")}
    in_pool = set(scan(store, "pool").filter(this).select("prompt_id").collect()["prompt_id"])
    cache = teacher_cache(store) if teacher is not None else {}
    children: list[dict] = []
    rows: list[dict] = []
    used = {s: 0 for s in [*cfg.strategies, "promote"]}
    pending: list[tuple[dict, str]] = []  # teacher_scaffold calls to make, batched
    payloads: dict[str, str] = {}  # every teacher call of the stage (scaffolds and distractors), by key

    def record(parent_id: str, strategy: str, child: dict | None, reason: str | None, call: dict | None = None,
               note: str | None = None):  # note: the reason column of an accepted row (a teacher fallback)
        accepted = child is not None and reason is None
        if accepted and any(c["prompt_id"] == child["prompt_id"] for c in children):
            return
        if accepted and child["prompt_id"] in in_pool and strategy != "promote":
            accepted, reason = False, "duplicate: already in this run's pool"
        rows.append({"parent_id": parent_id, "child_id": child["prompt_id"] if child else None, "strategy": strategy,
                     "accepted": accepted, "reason": reason or (note if accepted else None),
                     "teacher_call": json.dumps(call) if call else None})
        if accepted and child["prompt_id"] not in by_id:  # a child another run already made is reused as is
            children.append(child)
        used[strategy] += 1

    def room(strategy: str) -> bool:
        return used.get(strategy, 0) < cfg.max_per_strategy and sum(used.values()) < cfg.max_children

    distract = teacher is not None and cfg.teacher_distractors
    teacher_name = getattr(teacher, "name", "teacher")
    mcqs: list[tuple[dict, dict, str, str, str]] = []  # (parent, root, level, strategy, key): need the teacher

    def ladder(parent: dict, root: dict, level: str, strategy: str) -> None:
        if not distract or not level.startswith("mcq"):
            record(parent["prompt_id"], strategy, *ladder_child(parent, root, level, run_id, round))
            return
        key, payload = distractor_payload(root["text"], root["answer"], n_options(level) - 1, teacher_name)
        payloads[key] = payload
        used[strategy] += 1  # reserve the slot; the teacher calls are batched after the loop
        mcqs.append((parent, root, level, strategy, key))

    for s in scored.iter_rows(named=True):
        parent = by_id[s["prompt_id"]]
        root = by_id.get(parent["root_id"], parent)
        transform = parent["transform"]
        solved = s["mean_reward"] > cfg.promote_threshold
        if transform in LEVELS and solved and "ladder" in cfg.strategies and room("promote"):
            up = next_level(transform)
            if up == "cloze" and make_cloze(root["prompt_id"], root["text"], root["answer"]) is None:
                up = "open"  # a one-digit answer cannot be a cloze pattern
            if up == "open":
                record(parent["prompt_id"], "promote", root, None)
            else:
                ladder(parent, root, up, "promote")
            continue
        if transform == "hint_prefix" and solved and "hint_prefix" in cfg.strategies and room("promote"):  # annealing: f -> f - 0.1 -> ... -> open
            f = annealed_fraction(json.loads(parent["meta"] or "{}").get("hint_fraction", cfg.hint_fraction))
            record(parent["prompt_id"], "promote", *((root, None) if f == 0 else
                                                     hint_child(parent, f, run_id, round, root)))
            continue
        if transform != "original":
            continue
        if s["bucket"] in ("too_hard", "flat"):
            if "ladder" in cfg.strategies and room("ladder"):
                ladder(parent, parent, "mcq4", "ladder")
            if "hint_prefix" in cfg.strategies and room("hint_prefix") and parent.get("solution"):
                child, reason = hint_child(parent, cfg.hint_fraction, run_id, round)
                record(parent["prompt_id"], "hint_prefix", child, reason)
            if "teacher_scaffold" in cfg.strategies and teacher is not None and room("teacher_scaffold"):
                used["teacher_scaffold"] += 1  # reserve the slot; the calls are batched after the loop
                key, payload = teacher_payload(parent, groups.get(parent["prompt_id"], []), teacher)
                payloads[key] = payload
                pending.append((parent, key))
        elif s["bucket"] == "saturated" and "harden" in cfg.strategies and room("harden"):
            child, reason = harden_child(parent, run_id, round)
            record(parent["prompt_id"], "harden", child, reason)

    # a payload the teacher could not answer falls back per prompt, with "teacher unavailable: <why>" recorded,
    # and the round goes on; it is not cached, so a later round or run asks again
    fresh, failed = ask_teacher(store, teacher, payloads, cache, cfg.teacher_max_new_tokens) if payloads else (
        set(), {})
    fault_point("refine:mid")  # test hook: a fault test kills the process here, teacher calls landed, refine not

    def call(key: str) -> dict:
        if key in failed:
            return {"key": key, "teacher": teacher_name, "response": None, "reused": False, "error": failed[key]}
        return {"key": key, "teacher": teacher_name, "response": cache[key], "reused": key not in fresh}

    unavailable: set[str] = set()  # prompts (parent ids) some teacher call of which failed and fell back
    for parent, root, level, strategy, key in mcqs:
        used[strategy] -= 1
        if key in failed:
            unavailable.add(parent["prompt_id"])
        wrong = parse_distractors(cache[key], root["answer"], n_options(level) - 1) if key not in failed else []
        child, reason = ladder_child(parent, root, level, run_id, round, wrong)  # programmatic ones fill the rest
        note = f"{UNAVAILABLE}: {failed[key]}; programmatic distractors" if key in failed else None
        record(parent["prompt_id"], strategy, child, reason, call(key), note=note)
    # the rewrite gate judges every answered scaffold at once (one MiniLM call, one reference scoring call)
    gate = RewriteGate(RewriteBounds(cfg.gate_min_similarity, cfg.gate_min_word_share, cfg.gate_min_function_share,
                                     cfg.gate_max_logprob_drop), logprobs=logprobs)
    answered = [(p, k) for p, k in pending if cache.get(k)]  # a failed call is never cached
    verdicts = dict(zip([k for _, k in answered], gate.check(
        [(cache[k], p["text"], p["answer"], payloads[k]) for p, k in answered])))
    for parent, key in pending:
        used["teacher_scaffold"] -= 1
        if key in failed:
            unavailable.add(parent["prompt_id"])
            record(parent["prompt_id"], "teacher_scaffold", None, f"{UNAVAILABLE}: {failed[key]}", call(key))
            continue
        response = cache[key]
        if not response:
            record(parent["prompt_id"], "teacher_scaffold", None, f"{EMPTY_ANSWER}: the teacher returned nothing",
                   call(key))
            continue
        child = _child(parent, response, "teacher_scaffold", run_id, round)
        record(parent["prompt_id"], "teacher_scaffold", child, verdicts[key], call(key))

    now = datetime.now(UTC)
    tables = {"refinements": pa.Table.from_pylist(
        [{"run_id": run_id, "round": round, **r} for r in rows],
        schema=pa.schema([("run_id", pa.string()), ("round", pa.int32()), ("parent_id", pa.string()),
                          ("child_id", pa.string()), ("strategy", pa.string()), ("accepted", pa.bool_()),
                          ("reason", pa.string()), ("teacher_call", pa.string())]))}
    if children:
        tables["prompts"] = pa.Table.from_pylist([{**c, "created_at": now} for c in children])
    store.commit("refine", tables, run_id=run_id, round=round)
    summary = pl.DataFrame(rows, schema={"strategy": pl.String, "accepted": pl.Boolean}) if rows else None
    counts = ({f"{k}{'' if a else ' (rejected)'}": v for k, a, v in
               summary.group_by("strategy", "accepted").len().iter_rows()} if summary is not None else {})
    rejections: dict[str, int] = {}  # gate verdicts per stable category; SQL: split_part(reason, ':', 1)
    for r in rows:
        category = reason_category(r["reason"]) if not r["accepted"] and r["reason"] else None
        if category and category not in NOT_JUDGED:
            rejections[category] = rejections.get(category, 0) + 1
    return {"stage": "refine", "round": round, "children": len(children), "refinements": len(rows),
            "teacher_calls": len(fresh),  # answers asked for and received now (a failed call is teacher_unavailable)
            "by_strategy": counts, "rejections": dict(sorted(rejections.items())),
            "teacher_unavailable": len(unavailable)}  # prompts, not calls: a prompt can have two failed calls


@task(name="refine")
@timed
def refine_task(store_uri: str, run_id: str, round: int, cfg: Any, model_cfg: Any) -> dict:
    from models.registry import load_backend, load_teacher

    store = Store(store_uri)
    self_taught = "teacher_scaffold" in cfg.strategies and not cfg.scaffolds_run()
    if self_taught:  # skipped until a teacher other than the policy is set
        cfg = cfg.model_copy(update={"strategies": [s for s in cfg.strategies if s != "teacher_scaffold"]})
    wanted = "teacher_scaffold" in cfg.strategies or ("ladder" in cfg.strategies and cfg.teacher_distractors)
    teacher = load_teacher(cfg.teacher, model_cfg, cfg) if wanted else None
    reference = reference_policy(store, run_id, model_cfg.policy)

    def logprobs(texts: list[str]) -> list[float]:  # loads the reference only if a rewrite gets this far
        return mean_logprobs(load_backend(reference, "transformers", model_cfg.device, model_cfg.dtype,
                                          model_cfg.batch_size), texts)

    out = refine(store, run_id, round, cfg, teacher, logprobs=logprobs)
    if self_taught:
        out["teacher_scaffold"] = ("off: the teacher is the policy (set refine.teacher, or "
                                   "refine.scaffolds_from_policy = true)")
    return out


def reference_policy(store: Store, run_id: str, round_policy: str) -> str:
    """The run's base policy (version 0), the gate's reference model: its recorded checkpoint row once the
    first train stage landed, else the round's policy, which is the base until then."""
    from models.checkpoints import versions

    v0 = versions(store, run_id).filter(pl.col("policy_version") == 0)
    return v0["path"][0] if v0.height else round_policy
