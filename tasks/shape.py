"""Shape stage: MCMC on-policy shaping of off-policy traces (ALGORITHMS.md §5; arXiv 2610.02140, 2510.14901).

An off-policy trace y for prompt x (a reference solution, or a teacher's) is moved towards the policy's own
distribution while it keeps a verified answer: the chain targets p_C(y) ∝ π(y | x) 1[y ∈ C], C = the traces
the verifier accepts, π = the current policy without privileged context.

Proposal κ(y' | y): a cut point i ~ U{0..|y|-1}; keep y_<i and sample the suffix from π prompted with the
question, the reference trace and "continue this partial answer in your own words", then y_<i (the
privileged trace is only in the proposal's context). Acceptance
    A = min(1, π(y'|x) κ(y|y') / (π(y|x) κ(y'|y)))
      = min(1, exp([π(s'|x,y_<i) - π(s|x,y_<i)] + [q(s|c,y_<i) - q(s'|c,y_<i)]) * |y| / |y'|),
with s, s' the old and new suffixes and q the proposal model in context c. The prefix terms cancel; the cut
point's 1/|y| vs 1/|y'| does not when the lengths differ, so that factor is kept (ALGORITHMS.md says it
cancels; it only does for equal lengths). Proposals outside C are rejected without scoring. The greedy
variant accepts iff the mean per-token log-prob under π rises.

Batched: every step makes ONE generate call for all traces' proposals and ONE score call for their terms.
π(s | x, y_<i) of the current trace comes from a per-trace cache of its token log-probs, so only the new
suffix is scored under π. All randomness (cut points, acceptance uniforms, the suffix tokens via keyed
sampling) is drawn per trace, so a trace's chain is the same batched or alone (`shape_traces(batched=False)`).
Traces are token ids ending in end-of-sequence when the trace ended; scores include that token.
"""

from __future__ import annotations

import difflib
import hashlib
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import polars as pl
import pyarrow as pa
from prefect import task

from models.backend import Sampling
from storage.query import scan
from storage.store import Store, fault_point
from tasks.reporting import progress_reporter, sig4

CONTINUE = "Continue this partial answer in your own words."
TEACHER_SOLUTION = """Solve this problem step by step, briefly. Its correct final answer is {answer}; end with
\\boxed{{{answer}}}.

Problem:
{question}"""


@dataclass
class Trace:
    """One chain: the plain prompt's ids, the proposal context's ids, the current trace and its per-token
    log-probs under π, and its own random stream."""

    key: str
    prompt_ids: list[int]
    context_ids: list[int]
    ids: list[int]
    in_c: Any  # callable: token ids -> bool (the verifier)
    lp: list[float] = field(default_factory=list)
    start_ids: list[int] = field(default_factory=list)
    start_lp: list[float] = field(default_factory=list)
    accepted: int = 0
    proposed: int = 0
    decisions: list[bool] = field(default_factory=list)
    rng: random.Random | None = None

    @property
    def rng_seed(self) -> int:
        return int(hashlib.sha256(self.key.encode()).hexdigest()[:15], 16)

    def __post_init__(self):
        self.rng = random.Random(self.rng_seed)
        self.start_ids = list(self.ids)


def _mean(x: list[float]) -> float:
    return sum(x) / len(x) if x else float("nan")


def mh_log_accept(pi_new: float, pi_old: float, q_old: float, q_new: float, len_old: int, len_new: int) -> float:
    """log A (before the min with 0) from the suffix log-prob sums and the two trace lengths.

    >>> round(mh_log_accept(-2.0, -3.0, -1.0, -1.5, 10, 10), 6)
    1.5
    >>> round(mh_log_accept(-2.0, -2.0, -1.0, -1.0, 10, 20), 6) == round(math.log(0.5), 6)
    True
    """
    return (pi_new - pi_old) + (q_old - q_new) + math.log(len_old / len_new)


def _step(backend: Any, traces: list[Trace], step: int, variant: str, max_new_tokens: int, eos: int) -> None:
    """One MCMC step for every trace: one batched generate call, one batched score call."""
    cuts = [t.rng.randrange(len(t.ids)) for t in traces]
    us = [t.rng.random() for t in traces]
    seeds = [t.rng.getrandbits(31) for t in traces]
    prompts = [t.context_ids + t.ids[:i] for t, i in zip(traces, cuts)]
    out = backend.generate_ids(prompts, 1, Sampling(1.0, 1.0, max_new_tokens, step), row_seeds=seeds)
    news = []
    for t, i, g in zip(traces, cuts, out):
        c = g[0]
        suffix = list(c.token_ids) + ([eos] if c.finish_reason == "stop" else [])
        new = t.ids[:i] + suffix
        t.proposed += 1
        news.append((new, suffix) if suffix and t.in_c(new) else None)
    live = [k for k, n in enumerate(news) if n is not None]
    score_p, score_c = [], []
    for k in live:
        t, i, (_, suffix) = traces[k], cuts[k], news[k]
        score_p += [t.prompt_ids + t.ids[:i]]  # pi(s' | x, y_<i)
        score_c += [suffix]
        if variant == "mh":
            score_p += [t.context_ids + t.ids[:i], t.context_ids + t.ids[:i]]  # q(s | c, y_<i), q(s' | c, y_<i)
            score_c += [t.ids[i:], suffix]
    scored = backend.score_ids(score_p, score_c) if score_p else []
    at = 0
    for k, (t, i, u) in enumerate(zip(traces, cuts, us)):
        if news[k] is None:
            t.decisions.append(False)
            continue
        new, suffix = news[k]
        pi_new = scored[at]
        new_lp = t.lp[:i] + pi_new
        if variant == "mh":
            q_old, q_new = scored[at + 1], scored[at + 2]
            at += 3
            log_a = mh_log_accept(sum(pi_new), sum(t.lp[i:]), sum(q_old), sum(q_new), len(t.ids), len(new))
            accept = math.log(max(u, 1e-300)) < min(0.0, log_a)
        else:
            at += 1
            accept = _mean(new_lp) > _mean(t.lp)
        t.decisions.append(accept)
        if accept:
            t.ids, t.lp = new, new_lp
            t.accepted += 1


def shape_traces(backend: Any, traces: list[Trace], steps: int, variant: str = "mh", max_new_tokens: int = 64,
                 batched: bool = True, on_step=None) -> list[Trace]:
    """Run `steps` MCMC steps on every trace in C (the others are left as they are). Batched: one generate
    and one score call per step for all traces; otherwise the same chains one trace at a time."""
    if variant not in ("mh", "greedy"):
        raise ValueError(f"variant must be mh or greedy, got {variant!r}")
    eos = backend.eos_ids[0]
    live = [t for t in traces if t.ids and t.in_c(t.ids)]
    groups = [live] if batched else [[t] for t in live]
    for g in groups:
        if not g:
            continue
        for t, lp in zip(g, backend.score_ids([t.prompt_ids for t in g], [t.ids for t in g])):
            t.lp, t.start_lp = lp, list(lp)
    for s in range(steps):
        for g in groups:
            if g:
                _step(backend, g, s, variant, max_new_tokens, eos)
        if on_step:
            on_step(s)
    return traces


def tokens_changed(a: list[int], b: list[int]) -> int:
    """Tokens of the longer sequence that are not part of a matching block.

    >>> tokens_changed([1, 2, 3, 4], [1, 2, 9, 4, 5])
    2
    """
    matched = sum(m.size for m in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks())
    return max(len(a), len(b)) - matched


def _candidates(store: Store, run_id: str, round: int, limit: int) -> pl.DataFrame:
    """Up to `limit` prompts of this round that the policy did not solve once (mean reward 0), by prompt id."""
    this = (pl.col("run_id") == run_id) & (pl.col("round") == round)
    scores = scan(store, "prompt_scores").filter(this & (pl.col("mean_reward") <= 0.0)).select("prompt_id")
    prompts = scan(store, "prompts").select("prompt_id", "text", "answer", "solution", "source", "meta").unique(
        "prompt_id")
    return scores.join(prompts, on="prompt_id").sort("prompt_id").head(limit).collect()


def shape(store: Store, run_id: str, round: int, policy: str, cfg: Any, model_cfg: Any, rollout_cfg: Any,
          reward_cfg: Any, teacher_spec: str, teacher_max_new_tokens: int) -> dict:
    """The shape stage of (run_id, round) -> `shaped_traces`."""
    from models.registry import load_backend, load_teacher
    from tasks.refine import ask_teacher, teacher_cache
    from tasks.rewards import verify

    if store.landed(run_id, round, "shape"):
        return {"stage": "shape", "round": round, "skipped": "already landed"}
    cands = _candidates(store, run_id, round, cfg.max_traces)
    backend = load_backend(policy, model_cfg.backend, model_cfg.device, model_cfg.dtype, model_cfg.batch_size)
    if not hasattr(backend, "generate_ids"):
        raise ValueError(f"shaping needs a backend with token-level generate_ids/score_ids; "
                         f"{model_cfg.backend} has none")
    origins: dict[str, tuple[str, str]] = {}  # prompt_id -> (origin, trace text)
    for r in cands.iter_rows(named=True):
        if r["solution"]:
            origins[r["prompt_id"]] = ("reference", r["solution"])
    need = [r for r in cands.iter_rows(named=True) if r["prompt_id"] not in origins]
    calls = 0
    if need and cfg.teacher_traces:
        teacher = load_teacher(teacher_spec, model_cfg.model_copy(update={"policy": policy}))
        name = getattr(teacher, "name", "teacher")
        payloads = {}
        for r in need:
            text = TEACHER_SOLUTION.format(answer=r["answer"], question=r["text"])
            payloads[hashlib.sha256(f"{name}\x1fsolution\x1f{text}".encode()).hexdigest()[:24]] = text
        cache = teacher_cache(store)
        calls = len(ask_teacher(store, teacher, payloads, cache, teacher_max_new_tokens))
        for r, key in zip(need, payloads):
            origins[r["prompt_id"]] = ("teacher", cache[key])
    tok = backend.tokenizer
    eos = backend.eos_ids[0]
    traces, meta = [], []
    for r in cands.iter_rows(named=True):
        if r["prompt_id"] not in origins:
            continue
        origin, text = origins[r["prompt_id"]]
        question = f"{r['text']}\n{rollout_cfg.instruction}".strip()
        prompt_ids = backend.encode([backend.render([{"role": "user", "content": question}])])[0]
        ctx = backend.render([{"role": "user", "content": f"{question}\n\nReference solution:\n{text}\n\n{CONTINUE}"}])

        def in_c(ids, r=r):
            body = tok.decode([i for i in ids if i != eos], skip_special_tokens=True)
            return verify(body, r["answer"], r["source"], r["text"], r["meta"], reward_cfg.verifier,
                          reward_cfg.strict, reward_cfg.format_weight).correct

        ids = tok(text, add_special_tokens=False)["input_ids"][: 4 * cfg.max_new_tokens] + [eos]
        key = f"{run_id}\x1f{round}\x1f{r['prompt_id']}\x1f{origin}\x1f{cfg.seed}"
        traces.append(Trace(key, prompt_ids, backend.encode([ctx])[0], ids, in_c))
        meta.append((r["prompt_id"], origin, text))
    t0 = time.perf_counter()
    with progress_reporter(f"round {round}: shaping", cfg.steps) as advance:
        def on_step(s: int) -> None:
            advance(1)
            fault_point("shape:mid")  # test hook: a fault test kills the process here, mid-shaping

        shape_traces(backend, traces, cfg.steps, cfg.variant, cfg.max_new_tokens, on_step=on_step)
    rows = []
    for t, (pid, origin, text) in zip(traces, meta):
        in_c = bool(t.lp)  # scored = started in C; accepted moves never leave it
        rows.append({"run_id": run_id, "round": round, "prompt_id": pid,
                     "trace_id": hashlib.sha256(t.key.encode()).hexdigest()[:16], "origin": origin,
                     "variant": cfg.variant, "start_text": text,
                     "text": tok.decode([i for i in t.ids if i != eos], skip_special_tokens=True),
                     "start_logprob": _mean(t.start_lp) if in_c else None, "end_logprob": _mean(t.lp) if in_c else None,
                     "steps": cfg.steps if in_c else 0, "accept_rate": t.accepted / t.proposed if t.proposed else None,
                     "correct": in_c and t.in_c(t.ids), "tokens_changed": tokens_changed(t.start_ids, t.ids)})
    tables = {"shaped_traces": pa.Table.from_pylist(rows)} if rows else {}
    store.commit("shape", tables, run_id=run_id, round=round)
    kept = [r for r in rows if r["correct"]]
    return {"stage": "shape", "round": round, "traces": len(rows), "in_c": len(kept), "teacher_calls": calls,
            "accept_rate": sig4(_mean([r["accept_rate"] for r in kept])) if kept else None,
            "logprob_gain": sig4(_mean([r["end_logprob"] - r["start_logprob"] for r in kept])) if kept else None,
            "seconds": sig4(time.perf_counter() - t0)}


@task(name="shape")
def shape_task(store_uri: str, run_id: str, round: int, policy: str, cfg: Any, model_cfg: Any, rollout_cfg: Any,
               reward_cfg: Any, teacher_spec: str, teacher_max_new_tokens: int) -> dict:
    return shape(Store(store_uri), run_id, round, policy, cfg, model_cfg, rollout_cfg, reward_cfg, teacher_spec,
                 teacher_max_new_tokens)
