"""Shape stage: picks the round's unsolved prompts, builds their off-policy traces (reference solutions, or
teacher solutions that verify), runs the batched MCMC of tasks/core/mcmc.py under the round's policy with the
verifier deciding membership of C, and lands `shaped_traces`. A start trace longer than
shape.start_trace_factor x shape.max_new_tokens tokens (4 x 64 by default) is cut there, incomplete (no
end-of-sequence), and not shaped; the summary counts such starts and the moves rejected as irreversible or as
cut by the proposal limit (tasks/core/mcmc.py)."""

from __future__ import annotations

import time
from typing import Literal

import polars as pl
import pyarrow as pa
from pydantic import Field

from models.backend import require_tokens
from models.config import Section
from models.registry import load_model
from storage.rounds import prompts, this_round
from storage.store import Store, fault_point
from tasks.core.eps import own_samples
from tasks.core.fewshot import ask
from tasks.core.ids import KEY_HEX, digest
from tasks.core.mcmc import CONTINUE, Trace, mean, shape_traces, tokens_changed
from tasks.core.rewards import RewardConfig
from tasks.core.verdicts import verify_row
from tasks.reporting.progress import progress_reporter, sig4
from tasks.sampling.rollouts import RolloutConfig
from tasks.stage import RoundContext, stage
from tasks.strategies.teacher_calls import TeacherConfig, ask_teacher, teacher_cache


class ShapeConfig(Section):
    """MCMC on-policy shaping of off-policy traces (docs/algorithms.md §5)."""

    enabled: bool = Field(False, description="shape traces for prompts the policy cannot solve yet (off: at the "
                          "embedded 135M policy its traces yield fewer training rows per 1k tokens than plain "
                          "rollouts, and SFT on worked solutions did not lift held-out pass@1; "
                          "benchmarks/evidence_reading.md)")
    variant: Literal["mh", "greedy"] = Field("mh", description="mh: Metropolis-Hastings acceptance; greedy: "
                                             "accept iff the mean log-prob under the policy rises")
    steps: int = Field(8, ge=0, le=1000, description="S: MCMC steps per trace (0: a start trace that "
                       "verifies is trained on as written and no proposal is generated; the teacher still "
                       "writes start traces with teacher_traces)")
    max_traces: int = Field(8, ge=0, le=1_000_000, description="traces shaped per round")
    max_new_tokens: int = Field(64, ge=1, le=8192, description="longest proposed suffix")
    teacher_traces: bool = Field(True, description="where a prompt has no reference solution, ask the teacher "
                                 "(teacher.model) for one; only traces that verify are used")
    seed: int = Field(0, ge=0, description="MCMC proposal seed")
    start_trace_factor: int = Field(4, ge=1, le=1000, description="a start trace longer than this times "
                                    "max_new_tokens tokens is cut there and not shaped (incomplete: no end of "
                                    "sequence)")

TEACHER_SOLUTION = """Solve this problem step by step, briefly. Its correct final answer is {answer}; end with
\\boxed{{{answer}}}.

Problem:
{question}"""


def shaping_candidates(store: Store, run_id: str, round: int, limit: int) -> pl.DataFrame:
    """Up to `limit` prompts of this round that the policy did not solve once, by prompt id: no correct sample
    among its own samples (LoPE replacements are not its own; tasks/core/eps.py own_samples), in `rollouts` or
    in `discarded_rollouts`. Not mean reward 0: a never-solved prompt may still earn partial credit or a format
    reward. Discarded rows count because screening (tasks/sampling/screening.py) keeps only mixed groups in
    `rollouts`: there, the prompts the policy cannot solve are its all-fail screens and all-fail top-ups, and
    reading `rollouts` alone found 1 to 7 candidates in a whole evidence-v5 run of the default."""
    cols = ["prompt_id", "policy_version", "reward", "correct", "augmentation"]
    own = own_samples(pl.concat([this_round(store, t, run_id, round).select(cols)
                                 for t in ("rollouts", "discarded_rollouts")]))
    own = own.filter(pl.col("policy_version") == pl.col("policy_version").min())  # the round's policy, not a rescore
    unsolved = own.group_by("prompt_id").agg(solved=pl.col("correct").any()).filter(~pl.col("solved")).select(
        "prompt_id")
    return unsolved.join(prompts(store, "text", "answer", "solution", "source", "meta"), on="prompt_id").sort(
        "prompt_id").head(limit).collect()


@stage("shape")
def shape_task(ctx: RoundContext, store: Store, cfg: ShapeConfig, rollout_cfg: RolloutConfig,
               reward_cfg: RewardConfig, teacher_cfg: TeacherConfig) -> dict:
    """The shape stage of ctx's round -> `shaped_traces`. `teacher_cfg` (the [teacher] section, which refine
    reads too) names the teacher that writes traces for prompts without a reference solution and how it is
    asked; a prompt it cannot answer is skipped (counted as teacher_unavailable), and the stage goes on."""
    from models.registry import load_teacher

    run_id, round = ctx.run_id, ctx.round
    cands = shaping_candidates(store, run_id, round, cfg.max_traces)
    backend = require_tokens(load_model(ctx.model), "shaping (MCMC over token ids)")
    origins: dict[str, tuple[str, str]] = {}  # prompt_id -> (origin, trace text)
    for r in cands.iter_rows(named=True):
        if r["solution"]:
            origins[r["prompt_id"]] = ("reference", r["solution"])
    need = [r for r in cands.iter_rows(named=True) if r["prompt_id"] not in origins]
    calls, unavailable = 0, 0
    if need and cfg.teacher_traces:
        teacher = load_teacher(teacher_cfg.model, ctx.model, teacher_cfg)
        name = getattr(teacher, "name", "teacher")
        payloads, keys = {}, {}
        for r in need:
            text = TEACHER_SOLUTION.format(answer=r["answer"], question=r["text"])
            keys[r["prompt_id"]] = digest(f"{name}\x1fsolution\x1f{text}", KEY_HEX)
            payloads[keys[r["prompt_id"]]] = text  # two prompts with one question and answer share a call
        cache = teacher_cache(store)
        fresh, failed = ask_teacher(store, teacher, payloads, cache, teacher_cfg.max_new_tokens,
                                    teacher_cfg.temperature)
        calls = len(fresh)
        unavailable = sum(keys[r["prompt_id"]] in failed for r in need)  # prompts, not calls: some share a call
        for r in need:
            if keys[r["prompt_id"]] in cache:  # a prompt whose call failed gets no trace this round
                origins[r["prompt_id"]] = ("teacher", cache[keys[r["prompt_id"]]])
    tok = backend.tokenizer
    eos = backend.eos_ids[0]
    traces, meta = [], []
    for r in cands.iter_rows(named=True):
        if r["prompt_id"] not in origins:
            continue
        origin, text = origins[r["prompt_id"]]
        question = ask(r["text"], rollout_cfg.instruction)
        prompt_ids = backend.encode([backend.render([question])])[0]
        context = backend.render([{"role": "user",
                                   "content": f"{question['content']}\n\nReference solution:\n{text}\n\n{CONTINUE}"}])

        def in_c(ids: list[int], r: dict = r) -> bool:
            return verify_row(r, tok.decode([i for i in ids if i != eos], skip_special_tokens=True), reward_cfg).correct

        ids = tok(text, add_special_tokens=False)["input_ids"]
        cap = cfg.start_trace_factor * cfg.max_new_tokens  # the longest start trace shaped
        # a trace cut at the cap is incomplete: no EOS, so it is not shaped and never lands as correct (the
        # train stage appends EOS to every correct trace, which for a cut one would teach a false ending)
        ids = ids + [eos] if len(ids) <= cap else ids[:cap]
        # the chain's randomness is keyed by (seed, round, prompt, origin), not by run: two arms of a comparison
        # at one seed make the same proposals from the same start trace (paired seeds); trace_id adds the run
        key = f"{cfg.seed}\x1f{round}\x1f{r['prompt_id']}\x1f{origin}"
        traces.append(Trace(key, prompt_ids, backend.encode([context])[0], ids, in_c))
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
                     "trace_id": digest(f"{run_id}\x1f{t.key}"), "origin": origin,
                     "variant": cfg.variant, "start_text": text,
                     "text": tok.decode([i for i in t.ids if i != eos], skip_special_tokens=True),
                     "start_logprob": mean(t.start_lp) if in_c else None, "end_logprob": mean(t.lp) if in_c else None,
                     "steps": cfg.steps if in_c else 0, "accept_rate": t.accepted / t.proposed if t.proposed else None,
                     "correct": in_c and t.in_c(t.ids), "tokens_changed": tokens_changed(t.start_ids, t.ids)})
    tables = {"shaped_traces": pa.Table.from_pylist(rows)} if rows else {}
    store.commit("shape", tables, run_id=run_id, round=round)
    kept = [r for r in rows if r["correct"]]
    rates = [r["accept_rate"] for r in kept if r["accept_rate"] is not None]  # none without a proposal (steps 0)
    return {"traces": len(rows), "in_c": len(kept), "teacher_calls": calls,
            "teacher_unavailable": unavailable,
            "cut_starts": sum(not t.ids or t.ids[-1] not in backend.eos_ids for t in traces),  # as shape_traces tests
            "irreversible": sum(t.rejected_irreversible for t in traces),  # MH moves rejected: no reverse move
            "cut_proposals": sum(t.rejected_cut for t in traces),  # proposals cut by the length limit
            "accept_rate": sig4(mean(rates)) if rates else None,
            "logprob_gain": sig4(mean([r["end_logprob"] - r["start_logprob"] for r in kept])) if kept else None,
            "seconds": sig4(time.perf_counter() - t0)}
