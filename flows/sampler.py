"""A curriculum sampler another trainer's loop can call: Refinery picks each batch, the loop reports rewards.

    from flows.sampler import Sampler
    with Sampler("refinery-store", "trl-run", config="refinery.toml") as sampler:
        sampler.load_state_dict(checkpoint["sampler"])        # when the loop resumes from its checkpoint
        for step in range(...):
            batch = sampler.next_batch(8)                     # [{prompt_id, prompt (chat messages), answer, source}]
            ...generate, reward and update with your trainer...
            sampler.observe(prompt_ids, rewards)              # flat lists: one entry per completion
            save({"model": ..., "sampler": sampler.state_dict()})

Round r of the run is batch r. `next_batch` runs the flow's own stages for it (tasks/pool.py: the pool, with
the previous round's refinements and retirements; tasks/select.py: EPS-weighted k-means diverse selection, or
uniform, with `batch_size` = n); `observe` lands the rewards as the round's `rollouts` (completion text and
token counts when given), then scores EPS and buckets (tasks/score.py) and refines too-hard and saturated
prompts (tasks/refine.py). Every stage lands through the store like a `refinery run` round, so `refinery sql`,
`lineage`, `report` and `export` work on the run. The run's `runs` rows say `running` while a sampler holds it
and `completed` after `close()`; like a run, it holds the run's lock (one loop per run id).

Choices, and why:
- The sampler's position lives with the trainer's checkpoint (`state_dict()` is `{run_id, round}`); the data
  lives in the store. A new Sampler starts at round 0; a round whose batch already landed is served from the
  store as it was drawn, and `observe` on a round that already landed checks the ids and lands nothing. So a
  loop that restarts from its checkpoint (or from scratch) gets the very batches its model's lineage saw, in
  order: none repeated past the checkpoint, none skipped, whatever point the kill hit (tests/test_sampler.py
  kills the driving loop between a landed observation and its checkpoint). The rewards of a replayed round are
  those of its first observation.
- A round can be drawn only after the previous one was observed: the pool of round r needs round r-1's
  scores and refinements. `observe` needs every prompt of the batch (a group of one completion scores as
  too hard or saturated, never informative: report G >= 2 per prompt).
- Call `next_batch` once per training step from the loop (not from a prefetching data loader: until
  `observe` runs, it serves the same round again), and `observe` once per step with all of the step's rewards.
- `policy_version` of round r is r (the trainer updates once per batch, as on import); `correct` is reward >=
  `correct_at`. Selection, utility and refinement come from the run config's sections; a selector that
  `generates` (dapo_filter: its oversampling generates, and the sampler does not) or takes the `whole_pool`
  (all) is refused, and so is the `policy` embedder (the policy's checkpoints live in the external trainer).
- No evaluation, shaping or training: those belong to the external trainer. A refinement strategy that needs
  a teacher uses the config's [teacher] section as `refinery run` does.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack

import polars as pl
import pyarrow as pa

from flows.config import RunConfig, load_config, renamed
from flows.preflight import validate_for_run
from flows.resume import keep_stored, stored_fields
from storage.rounds import pool_candidates, prompts, this_round
from storage.runs import mark, run_lock, stored_config
from storage.schemas import TABLES
from storage.store import Store, fault_point
from tasks.core.fewshot import ask
from tasks.pool import pool_task
from tasks.refine import refine_task
from tasks.score import score_task
from tasks.select import select_task
from tasks.selectors import REGISTRY, selector
from tasks.stage import RoundContext


def batch_selectors() -> list[str]:
    """The registered selectors the sampler can serve: those that pick a batch without generating."""
    return sorted(n for n, s in REGISTRY.items() if not s.generates and not s.whole_pool)


class Sampler:
    """Refinery's curriculum for an external training loop, backed by the store (module docstring)."""

    def __init__(self, store: str, run_id: str, config: str | RunConfig | None = None, sets: Sequence[str] = (),
                 correct_at: float = 1.0):
        if isinstance(config, RunConfig):
            cfg = config.model_copy(update={"run_id": run_id, "store": store})
        else:
            cfg = load_config(config, list(sets), run_id=run_id, store=store)
        chosen = selector(cfg.select.selector)
        if chosen.generates:
            raise ValueError(f"select.selector {chosen.name} oversamples by generating; the sampler does not "
                             f"generate: use one of {', '.join(batch_selectors())}")
        if chosen.whole_pool:
            raise ValueError(f"select.selector {chosen.name} draws the whole pool; the sampler draws batches: use one "
                             f"of {', '.join(batch_selectors())}")
        if cfg.select.embedder == "policy":
            raise ValueError("select.embedder policy embeds with the policy's checkpoints, which live in the external "
                             "trainer: use minilm or hashing")
        validate_for_run(cfg)
        self.config, self.run_id, self.correct_at, self.round = cfg, run_id, correct_at, 0
        self.store = Store(store)
        self.store.cleanup()
        self._held = ExitStack()
        self._held.enter_context(run_lock(self.store, run_id))
        try:
            previous = stored_config(self.store, run_id)
            if previous is not None and previous.get("sampler") is None:
                raise ValueError(f"run {run_id} exists and was not made by a sampler; choose another run id")
            if previous is not None:  # a default changed since (soften joined the strategies) keeps the run's own
                self.config = keep_stored(self.config, previous)
                if _essential(_as_today(previous)) != _essential(self._recorded()):
                    raise ValueError(f"run {run_id} was sampled with another config (pool, select, utility, refine, "
                                     "teacher, rollout.instruction, rollout.include_reserve or correct_at differ); "
                                     "choose another run id")
            mark(self.store, run_id, "running", self._recorded())
        except BaseException:
            self._held.close()
            raise

    # -- the trainer's side -------------------------------------------------------------------------------

    def next_batch(self, n: int) -> list[dict]:
        """Round `self.round`'s batch of (up to) n prompts: prompt_id, prompt (chat messages: the question and
        the run's instruction), answer, source. Served from the store when the round was drawn before."""
        if n < 1:
            raise ValueError(f"next_batch(n): n must be >= 1, got {n}")
        r = self.round
        if not self.store.landed(self.run_id, r, "select"):
            if r > 0 and not self.store.landed(self.run_id, r - 1, "score"):
                raise ValueError(f"round {r - 1}'s batch was not observed yet: call observe() before next_batch()")
            ctx = self._ctx(r)
            # nothing held out; the split still records each prompt's stratum (select.strata reads it)
            pool_task.fn(ctx, self.config.pool, 0.0, self.config.eval.seed, self.config.eval.heldout_split)
            select = self.config.select.model_copy(update={"batch_size": n})
            select_task.fn(ctx, select, self.config.rollout.include_reserve)
            return self._batch(r)
        batch = self._batch(r)
        if len(batch) > n or (len(batch) < n and self._candidates(r) > len(batch)):
            raise ValueError(f"round {r}'s batch was drawn with {len(batch)} prompts; next_batch({n}) must ask for "
                             "the same size when it replays a round")
        return batch

    def observe(self, prompt_ids: Sequence[str], rewards: Sequence[float],
                completions: Sequence[str] | None = None, n_tokens: Sequence[int] | None = None) -> dict:
        """Land round `self.round`'s rewards (one entry per completion; a prompt's completions form its group),
        score and refine, and move to the next round. Returns the round's bucket counts."""
        r = self.round
        if not self.store.landed(self.run_id, r, "select"):
            raise ValueError(f"round {r} has no batch yet: call next_batch() first")
        ids, rewards = [str(p) for p in prompt_ids], [float(x) for x in rewards]
        batch = {b["prompt_id"]: b for b in self._batch(r)}
        for name, seq in (("rewards", rewards), ("completions", completions), ("n_tokens", n_tokens)):
            if seq is not None and len(seq) != len(ids):
                raise ValueError(f"observe: {len(ids)} prompt_ids but {len(seq)} {name}")
        now = Counter(ids)  # completions per prompt: the groups
        unknown = [p for p in now if p not in batch]
        if unknown:
            raise ValueError(f"observe: prompt {unknown[0]} is not in round {r}'s batch")
        unseen = [p for p in batch if p not in now]
        if unseen:
            raise ValueError(f"observe: round {r}'s batch prompt {unseen[0]} has no completion (every prompt of the "
                             "batch needs its group)")
        bad = [x for x in rewards if not math.isfinite(x)]
        if bad:
            raise ValueError(f"observe: reward {bad[0]} is not a finite number")
        if not ids:
            raise ValueError("observe: no prompt_ids")
        ctx = self._ctx(r)
        if self.store.landed(self.run_id, r, "collect"):  # a replayed round: the first observation stands
            landed = dict(this_round(self.store, "rollouts", self.run_id, r).group_by("prompt_id").len()
                          .collect().iter_rows())
            differ = sorted(p for p in landed.keys() | now.keys() if landed.get(p, 0) != now.get(p, 0))
            if differ:
                raise ValueError(f"observe: round {r} was observed before with {landed.get(differ[0], 0)} "
                                 f"completions of prompt {differ[0]}, now {now.get(differ[0], 0)}; a replayed round "
                                 "must report the same groups")
        else:
            self.store.commit("collect", {"rollouts": self._rollouts(r, ids, rewards, completions, n_tokens, batch)},
                              run_id=self.run_id, round=r)
        score_task.fn(ctx, self.config.utility)
        if self.config.refine.strategies:
            refine_task.fn(ctx, self.config.refine, self.config.teacher)
        fault_point(f"sampler:observed:{r}")  # test hook: killed here, the round landed, the trainer's checkpoint not
        self.round = r + 1
        buckets = this_round(self.store, "prompt_scores", self.run_id, r).group_by("bucket").len().collect()
        return dict(buckets.iter_rows())

    def state_dict(self) -> dict:
        """What the trainer saves with its checkpoint: the run and the next round."""
        return {"run_id": self.run_id, "round": self.round}

    def load_state_dict(self, state: dict) -> None:
        """Resume at a checkpoint's position (its batches come back from the store as they were drawn)."""
        if state.get("run_id") != self.run_id:
            raise ValueError(f"sampler state is of run {state.get('run_id')!r}, this sampler samples {self.run_id!r}")
        r = state.get("round")
        if not isinstance(r, int) or r < 0:
            raise ValueError(f"sampler state round {r!r} is not a round number")
        if r > 0 and not self.store.landed(self.run_id, r - 1, "score"):
            raise ValueError(f"sampler state says round {r}, but round {r - 1} of run {self.run_id} was never "
                             f"observed in {self.store.uri}: a state saved against another store")
        self.round = r

    def close(self, completed: bool = True) -> None:
        """Mark the run completed (or failed) and release its lock."""
        if self._held is None:
            return
        try:
            mark(self.store, self.run_id, "completed" if completed else "failed", self._recorded(),
                 reason=None if completed else "the sampling loop raised")
        finally:
            self._held.close()
            self._held = None

    def __enter__(self) -> Sampler:
        return self

    def __exit__(self, kind, value, tb) -> None:
        self.close(completed=kind is None)

    # -- the store's side ---------------------------------------------------------------------------------

    def _recorded(self) -> dict:
        return {**self.config.model_dump(mode="json"), "sampler": {"correct_at": self.correct_at}}

    def _ctx(self, r: int) -> RoundContext:
        return RoundContext(store=self.store.uri, run_id=self.run_id, round=r, policy_version=r,
                            base=self.config.model.policy, rounds=max(r + 2, self.config.rounds),
                            model=self.config.model, scale=self.config.scale)

    def _candidates(self, r: int) -> int:
        return pool_candidates(self.store, self.run_id, r, self.config.rollout.include_reserve,
                               self.config.select.strata).select(pl.len()).collect().item()

    def _batch(self, r: int) -> list[dict]:
        chosen = (this_round(self.store, "selections", self.run_id, r).select("prompt_id")
                  .join(prompts(self.store, "text", "answer", "source"), on="prompt_id", how="left")
                  .sort("prompt_id").collect())
        instruction = self.config.rollout.instruction
        return [{"prompt_id": p, "prompt": [ask(t, instruction)], "answer": a, "source": s}
                for p, t, a, s in chosen.select("prompt_id", "text", "answer", "source").iter_rows()]

    def _rollouts(self, r: int, ids: list[str], rewards: list[float], completions, n_tokens, batch) -> pa.Table:
        """One `rollouts` row per reported completion; `sample_idx` numbers a prompt's completions in order."""
        frame = pl.DataFrame({"prompt_id": ids, "reward": rewards,
                              "completion": completions if completions is not None else [""] * len(ids),
                              "n_tokens": n_tokens if n_tokens is not None else [0] * len(ids)},
                             schema_overrides={"reward": pl.Float64, "n_tokens": pl.Int32})
        frame = frame.with_columns(
            pl.lit(self.run_id).alias("run_id"), pl.lit(r, pl.Int32).alias("round"),
            pl.lit(r, pl.Int32).alias("policy_version"),
            pl.int_range(pl.len(), dtype=pl.Int32).over("prompt_id").alias("sample_idx"),
            pl.col("prompt_id").replace_strict({p: b["prompt"][0]["content"] for p, b in batch.items()})
            .alias("prompt_text"),
            (pl.col("reward") >= self.correct_at).alias("correct"),
            pl.lit(None, pl.Float64).alias("mean_logprob"), pl.lit("stop").alias("finish_reason"),
            pl.concat_str(pl.lit('{"sampler": {"index": '), pl.int_range(pl.len()).cast(pl.String), pl.lit("}}"))
            .alias("augmentation"),
            pl.lit(None, pl.Boolean).alias("verify_timeout"), pl.lit(None, pl.List(pl.Int32)).alias("token_ids"),
            pl.lit(None, pl.List(pl.Float32)).alias("token_logprobs"))
        return frame.select(TABLES["rollouts"].names).to_arrow().cast(TABLES["rollouts"])


def _as_today(previous: dict) -> dict:
    """A stored sampler config read through today's RunConfig (flows/resume.py `stored_fields`): a field added
    since takes what the run ran with, so it does not read as a difference."""
    return {**stored_fields(previous), "sampler": previous.get("sampler")}


def _essential(config: dict) -> dict:
    """What a resumed sampler must share with the run's first one: everything that decides the batches
    (`select.batch_size` aside: next_batch's n sets it)."""
    config = renamed(config)  # a run stored before the [teacher] section: its refine.teacher* fields moved there
    select = {k: v for k, v in (config.get("select") or {}).items() if k != "batch_size"}
    rollout = config.get("rollout") or {}
    return {"pool": config.get("pool"), "select": select, "utility": config.get("utility"),
            "refine": config.get("refine"), "teacher": config.get("teacher"), "sampler": config.get("sampler"),
            "instruction": rollout.get("instruction"), "include_reserve": rollout.get("include_reserve")}
