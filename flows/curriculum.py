"""The curriculum flow: R rounds of pool -> select -> collect -> score -> refine -> shape (with
`shape.enabled`, off by default) -> train -> evaluate over one experience store.

Choices, and why:
- Every stage is a Prefect task that commits one store partition and returns a small summary; large data
  never passes through Prefect results.
- Resume is store-driven: a stage whose commit record exists is skipped, so rerunning a run_id continues at
  the first stage that has not landed, whatever killed it.
- Round r samples the newest checkpoint trained before it (version r with training on, else the base model as
  version 0); training writes version r + 1, which the evaluate stage scores on the held-out split when it is
  due: after every round (eval.milestone_tokens 0), or when the round's generated tokens first reach a
  multiple of eval.milestone_tokens, and at the run's end (tasks/evaluate.py). Round 0 also scores version 0,
  so the eval curve starts at the base model. The decision is read from the store, so a run killed between
  a milestone's training and its evaluation evaluates it on resume.
- Each round ends with the report stage (plots and an HTML page under <store>/_reports/run_id=<run>/, redrawn
  from the store) and publishes Prefect artifacts: a keyed table per round and a markdown summary.
- `max_generated_tokens` (a token budget, for comparisons at equal compute): before each round the flow sums
  the run's `generated_tokens` of the earlier rounds (evaluation excluded: tasks/reporting/budget.py, the sum
  the end-of-run summary prints too) and stops once they reach it. The round whose full batch would cross it
  selects only the prompts that fit what is left, at the round before's tokens per pick, and is the last
  (tasks/core/budget.py), so a run ends within about half a prompt's tokens of its budget instead of up to a
  round past it (with selector `all`, which has no batch, the crossing round still runs whole). The run is
  then `completed` with the reason in `runs.reason`; raising the budget (or `rounds`) and resuming continues.
- Selection (k-means over prompt embeddings, weighted by last round's EPS) picks each round's batch from
  the active pool; selector 'all' collects the whole pool instead.
"""

from __future__ import annotations

import logging
import time

from prefect import flow

from flows.cli.errors import reason as failure_reason
from flows.config import RunConfig, placed
from flows.preflight import validate_for_run
from flows.resume import check_resume, keep_stored
from models.checkpoints import policy_for_round, prune_checkpoints
from models.memory import only_new_objects
from storage.runs import mark, run_lock, stored_config
from storage.store import Store
from tasks.collect import collect_task
from tasks.core.budget import Fit, fitted_batches
from tasks.evaluate import due, evaluate_task
from tasks.govern import govern_task, held_sections
from tasks.pool import pool_task
from tasks.refine import asks_the_policy, refine_task
from tasks.report import publish_round_artifacts, report_task
from tasks.reporting.budget import tokens_by_round
from tasks.score import score_task
from tasks.select import select_task
from tasks.selectors import selector
from tasks.shape import shape_task
from tasks.stage import RoundContext
from tasks.train import train_task

log = logging.getLogger(__name__)
# one line per finished stage: `refinery run` prints it (Prefect's own console log is off there without -v)
progress = logging.getLogger("refinery.progress")

@flow(name="curriculum")
def curriculum(config: RunConfig = RunConfig()) -> dict:  # noqa: B008 (a pydantic default the UI form shows)
    """Run (or resume) a curriculum run; returns per-stage summaries."""
    config = placed(config)
    # Before the lock and any `runs` row: a config this machine cannot run (unknown task or model, missing
    # file, unusable backend) lands nothing, so the same run id works once it is fixed. The CLI has already
    # checked it (a no-op here); a UI or deployment run is checked only here.
    validate_for_run(config)
    store = Store(config.store)
    store.cleanup()
    with run_lock(store, config.run_id), only_new_objects():  # one run per id; gc passes visit the run's objects
        return _rounds(config, store)


def _rounds(config: RunConfig, store: Store) -> dict:
    previous = stored_config(store, config.run_id)
    if previous is not None:
        config = keep_stored(config, previous)
    changes = check_resume(config, previous) if previous is not None else None
    if previous is not None and store.landed(config.run_id, config.rounds, "collect"):
        last = config.rounds
        while store.landed(config.run_id, last + 1, "collect"):
            last += 1
        raise ValueError(f"run {config.run_id} has already run rounds 0-{last}: rounds = {config.rounds} would end "
                         f"it before rounds it has landed (and evaluate a checkpoint that may be pruned); resume "
                         f"with rounds >= {last + 1}, or choose a new --run-id")
    status = mark(store, config.run_id, "running", config.model_dump(mode="json"), reason=changes)
    stages: list[dict] = []
    budget = None
    t0 = time.perf_counter()
    try:
        base = config.model.policy
        refine_asks_policy = bool(config.refine.strategies) and asks_the_policy(config.refine, config.teacher)
        for r in range(config.rounds):
            tokens = tokens_by_round(store, config.run_id, r)  # one read: the budget's sum and its fit
            spent = sum(tokens)
            fit, budget = budget_fit(config, tokens)
            if budget is not None:
                log.info(budget)
                break
            first = len(stages)
            # on resume, a round whose train stage landed loads its policy no more (evaluate reads the next one),
            # and keep_checkpoints = evaluated may have deleted its folder; only a pending refine (a resume that
            # raised `rounds` gives the old last round one) whose teacher is the policy still loads it
            final = fit.last or r + 1 == config.rounds  # the run's last round, unless a resume raises its limit
            teaching = refine_asks_policy and not final
            done = (config.train.enabled and store.landed(config.run_id, r, "train")
                    and not (teaching and not store.landed(config.run_id, r, "refine")))
            version, spec = policy_for_round(store, config.run_id, r, base, need_weights=not done)
            ctx = RoundContext(store=store.uri, run_id=config.run_id, round=r, policy_version=version, base=base,
                               rounds=config.rounds, model=config.model.model_copy(update={"policy": spec}),
                               scale=config.scale, token_budget=config.max_generated_tokens, tokens_spent=spent)
            heldout = config.eval.heldout_fraction if config.eval.enabled else 0.0
            finished(stages, pool_task(ctx, config.pool, heldout, config.eval.seed, config.eval.heldout_split))
            if config.governor.enabled:  # throttled components are held at their minimum this round
                finished(stages, govern_task(ctx, config.governor, config.rollout.screen_samples))
            held = held_sections(store, config.run_id, r, {"rollout": config.rollout, "shape": config.shape,
                                                           "refine": config.refine})
            selecting = not selector(config.select.selector).whole_pool  # `all`: collect reads the pool
            picking = config.select
            if fit.last:
                picking = config.select.model_copy(update={"batch_size": fit.batch})
                log.info("round %d: the token budget's last round: %d of %d prompts fit the %d tokens left",
                         r, fit.batch, config.select.batch_size, config.max_generated_tokens - spent)
            if selecting:
                finished(stages, select_task(ctx, picking, config.rollout.include_reserve))
            finished(stages, collect_task(ctx, held["rollout"], config.reward, picking, selecting))
            finished(stages, score_task(ctx, config.utility))
            if config.refine.strategies and not final:  # children of the last round would never run
                finished(stages, refine_task(ctx, held["refine"], config.teacher))
            if config.shape.enabled:
                finished(stages, shape_task(ctx, held["shape"], config.rollout, config.reward, config.teacher))
            if config.train.enabled:
                finished(stages, train_task(ctx, config.train, config.rollout))
            if config.eval.enabled:
                finished(stages, *evaluation(store, config, ctx, spent))
            finished(stages, report_task(ctx))
            publish_round_artifacts(store, config.run_id, r, stages[first:])
            if config.train.keep_checkpoints == "evaluated":  # after the round's evaluation: never a version it reads
                pruned = prune_checkpoints(store, config.run_id)
                if pruned:
                    log.info("round %d: deleted the folders of checkpoints %s (train.keep_checkpoints = evaluated)",
                             r, ", ".join(f"v{v}" for v in pruned))
    except BaseException as e:
        mark(store, config.run_id, "failed", config.model_dump(mode="json"), reason=failure_reason(e))
        raise
    mark(store, config.run_id, "completed", config.model_dump(mode="json"), reason=budget)
    return {"run_id": config.run_id, "store": store.uri, "started_as": status, "stages": stages,
            "seconds": time.perf_counter() - t0, **({"stopped": budget} if budget else {})}


def budget_fits(config: RunConfig, tokens: list[int]) -> list[Fit] | None:
    """The fit of rounds 0..len(tokens) to the token budget (tasks/core/budget.py: B prompts, fewer in the
    budget's last round, 0 after it) from the counted tokens of the rounds before (`tokens_by_round`); None
    without a budget, or with a selector that collects the whole pool (`all`: no batch to fit, so the round
    that reaches the budget is the last)."""
    if config.max_generated_tokens is None or selector(config.select.selector).whole_pool:
        return None
    return fitted_batches(tokens, config.max_generated_tokens, config.select.batch_size)


def budget_fit(config: RunConfig, tokens: list[int]) -> tuple[Fit, str | None]:
    """The fit of the round after `tokens` (the counted tokens of rounds 0..r-1) to the token budget, and why
    the run stops before it, if it does."""
    r, spent, cap = len(tokens), sum(tokens), config.max_generated_tokens
    fits = budget_fits(config, tokens)
    fit = fits[r] if fits is not None else Fit(config.select.batch_size, False)
    if cap is None:
        return fit, None
    if spent >= cap:
        return fit, (f"token budget reached: {spent} generated tokens in rounds 0-{r - 1} >= max_generated_tokens "
                     f"{cap}; stopped before round {r}")
    if fit.batch > 0:
        return fit, None
    lasts = [k for k in range(r) if fits[k].last and fits[k].batch > 0]
    why = (f"round {lasts[-1]} was the token budget's last" if lasts else
           f"the {cap - spent} tokens left of max_generated_tokens {cap} buy less than half a prompt")
    return fit, f"token budget reached: {why} ({spent} generated tokens in rounds 0-{r - 1}); stopped before round {r}"


def budget_ends(config: RunConfig, tokens: list[int]) -> bool:
    """Whether the token budget ends the run after the rounds of `tokens` (their counted tokens, all landed):
    the last reached the budget, or was the budget's last, or left less than half a prompt for the next."""
    if config.max_generated_tokens is None:
        return False
    fits = budget_fits(config, tokens)
    return fits[-1].batch == 0 if fits is not None else sum(tokens) >= config.max_generated_tokens


def evaluation(store: Store, config: RunConfig, ctx: RoundContext, spent: int) -> list[dict]:
    """The round's evaluate stage, if it is due (tasks/evaluate.py `due`: every round, or a milestone the round
    reached, or the run's end: its last round, or the last the token budget allows, which counts as reaching
    the budget's milestone; round 0 always scores the base model, milestone 0): its summary, or nothing.
    The new checkpoint's weights are wanted only when it is due (else retention may have deleted them)."""
    r, base = ctx.round, config.model.policy
    tokens = tokens_by_round(store, config.run_id, r + 1)
    after = sum(tokens)
    ends = budget_ends(config, tokens)
    # the budget's last round was sized to end at the budget: it reaches the budget's milestone even where it
    # came in a few tokens short (its row still records the tokens it had)
    reached = max(after, config.max_generated_tokens) if ends else after
    now, mark = due(config.eval, spent, reached, ends or r + 1 == config.rounds)
    new = policy_for_round(store, config.run_id, r + 1, base, need_weights=now)
    versions = [(0, base)] if r == 0 and new[0] != 0 else []
    at = {0: (0, 0), new[0]: (mark, after) if new[0] else (0, 0)}  # the base model is milestone 0
    if now or (r == 0 and new[0] == 0):  # training off: version 0, the base model, is scored in round 0
        versions.append(new)
    if not versions:
        return []
    # every-round evaluation writes its rows as before milestones existed (milestone, generated_tokens null)
    return [evaluate_task(ctx, versions, config.eval, config.rollout, config.reward,
                          at if config.eval.milestone_tokens else None)]


def finished(stages: list[dict], *summaries: dict) -> None:
    """Keep each stage's summary and say on `progress` that it finished (or had landed before this run)."""
    for summary in summaries:
        _finished(stages, summary)


def _finished(stages: list[dict], summary: dict) -> None:
    stages.append(summary)
    where = f"round {summary.get('round')}: {summary.get('stage')}"
    if summary.get("skipped"):
        progress.info("%s had landed already", where)
    else:
        progress.info("%s done in %.1f s", where, (summary.get("timing") or {}).get("compute_s") or 0.0)

