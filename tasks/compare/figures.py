"""The figures of a comparison (flows/compare.py), read from the store by SQL (docs/evidence.md).

Every number comes from one of the queries below, run by `storage.query.sql` over the runs whose ids start
with the comparison's prefix; docs/evidence.md prints the same queries, so each figure can be reproduced with
`refinery sql`. The Python side only interpolates and bootstraps what they return:

- `CHECKPOINTS`: each evaluated checkpoint's cost on three axes: the run's generated tokens before it (the
  rounds that trained it and every round before; evaluation excluded), its optimizer steps, and its
  wall-clock seconds (the checkpoint's `created_at` less the run's first; this includes the held-out
  evaluations and reports of the earlier checkpoints, a cost per checkpoint, so arms with more, cheaper
  rounds pay more of it, and any time the run stood stopped before it was resumed).
  A checkpoint evaluated at a generated-token milestone (evals.milestone, tasks/evaluate.py) also has the
  milestone: the token axis places it there (`run_curves`), so arms evaluated at the same milestones are
  compared at them, with no interpolation inside a round; a run's last checkpoint without one keeps its tokens.
- `PASS`: per-prompt pass@1 (and tokens) of every evaluated checkpoint on a split (`heldout`, or an
  external `dataset:<name>`); a checkpoint evaluated again (`refinery eval`) samples with the same seed, so
  its first evaluation stands for it.
- `GROUPS`: the informative-group ratio: groups whose rewards differ (standard deviation above 1e-6, the
  trainer's zero-variance threshold: the groups that give GRPO a non-zero advantage), over every group
  generated. A kept group is read as trained, from `rollouts` (LoPE's
  replacements included: rescuing a group is what LoPE is for); the groups DAPO generated and discarded
  count as generated and never informative, so over-sampling does not get its ratio for free.
- `DISCARDED`: rollouts generated and dropped (DAPO's zero-variance and surplus groups) as a share of all
  rollouts generated.
- `TOKENS`: generated tokens by purpose (rollout, lope, teacher, mcmc, rescore, eval).
- `TRAINED`: optimizer steps and the tokens they stepped on, per run (beside generated tokens; prefill is not
  recorded anywhere).
- `YIELDS`: what each token-spending component on top of plain rollouts (LoPE, shaping, refinement, the
  posterior's top-ups) made per 1k of its tokens, beside plain rollouts' yield in the same rounds, as the budget
  governor measured them (`governor`, tasks/core/governor.py): per run and component, the rounds it generated
  in (where plain rollouts had a yield too), its tokens and training rows there, the sums of its and the
  baseline's per-round yields over those rounds (the page prints their means), the rounds it fell below the
  baseline and the rounds it ran throttled. The governor measures a round when it decides the next, so a run's
  last round is not in it.

`arm_at` gives an arm's [seeds, prompts] pass@1 at a budget on one axis (tasks/core/curves.py), from which
tasks/core/stats.py gives the mean, its interval and paired differences.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from storage.query import sql
from storage.store import Store, check_name
from tasks.core.curves import at_budget
from tasks.reporting.budget import COUNTED_SQL

AXES = {"tokens": "generated tokens", "steps": "optimizer steps", "seconds": "wall-clock seconds"}

CHECKPOINTS = """
WITH spent AS (SELECT run_id, round, sum(tokens) AS tokens FROM generated_tokens
               WHERE """ + COUNTED_SQL + """ AND starts_with(run_id, '{prefix}') GROUP BY ALL),
     stepped AS (SELECT run_id, round, count(*) AS steps FROM train_steps
                 WHERE starts_with(run_id, '{prefix}') GROUP BY ALL),
     started AS (SELECT run_id, min(created_at) AS t0 FROM runs WHERE starts_with(run_id, '{prefix}') GROUP BY ALL),
     versions AS (SELECT DISTINCT run_id, policy_version FROM eval_results
                  WHERE split = 'heldout' AND starts_with(run_id, '{prefix}')),
     made AS (SELECT run_id, policy_version, min(created_at) AS created_at FROM checkpoints
              WHERE starts_with(run_id, '{prefix}') GROUP BY ALL),
     marks AS (SELECT run_id, policy_version, arg_min(milestone, round) AS milestone FROM evals
               WHERE split = 'heldout' AND starts_with(run_id, '{prefix}') GROUP BY ALL)
SELECT v.run_id, v.policy_version, m.milestone,
       (SELECT coalesce(sum(s.tokens), 0) FROM spent s
        WHERE s.run_id = v.run_id AND s.round < v.policy_version) AS tokens,
       (SELECT coalesce(sum(s.steps), 0) FROM stepped s
        WHERE s.run_id = v.run_id AND s.round < v.policy_version) AS steps,
       CASE WHEN v.policy_version = 0 THEN 0.0
            ELSE epoch(c.created_at) - epoch(st.t0) END AS seconds
FROM versions v JOIN started st USING (run_id)
LEFT JOIN made c ON c.run_id = v.run_id AND c.policy_version = v.policy_version
LEFT JOIN marks m ON m.run_id = v.run_id AND m.policy_version = v.policy_version
ORDER BY v.run_id, v.policy_version
""".strip()

PASS = """
SELECT run_id, policy_version, prompt_id, n_correct / n_samples AS pass1, n_samples, n_correct, n_tokens
FROM eval_results
WHERE split = '{split}' AND starts_with(run_id, '{prefix}')
QUALIFY row_number() OVER (PARTITION BY run_id, policy_version, prompt_id ORDER BY round) = 1
ORDER BY run_id, policy_version, prompt_id
""".strip()

GROUPS = """
WITH kept AS (SELECT run_id, round, prompt_id, stddev_pop(reward) > 1e-6 AS informative FROM rollouts
              WHERE starts_with(run_id, '{prefix}') GROUP BY ALL),
     dropped AS (SELECT run_id, count(DISTINCT (round, gen_batch, prompt_id)) AS groups FROM discarded_rollouts
                 WHERE starts_with(run_id, '{prefix}') GROUP BY ALL),
     collected AS (SELECT run_id, count(DISTINCT round) AS rounds FROM generated_tokens
                   WHERE starts_with(run_id, '{prefix}') AND stage = 'collect' GROUP BY ALL)
SELECT k.run_id, coalesce(any_value(c.rounds), 0) AS rounds, count(*) AS kept_groups,
       coalesce(any_value(d.groups), 0) AS discarded_groups,
       sum(CASE WHEN k.informative THEN 1 ELSE 0 END) AS informative_groups,
       sum(CASE WHEN k.informative THEN 1 ELSE 0 END) / (count(*) + coalesce(any_value(d.groups), 0)) AS informative
FROM kept k LEFT JOIN dropped d USING (run_id) LEFT JOIN collected c USING (run_id) GROUP BY k.run_id
ORDER BY k.run_id
""".strip()

DISCARDED = """
SELECT k.run_id, k.n AS kept, coalesce(d.n, 0) AS discarded, coalesce(d.n, 0) / (k.n + coalesce(d.n, 0)) AS share
FROM (SELECT run_id, count(*) AS n FROM rollouts WHERE starts_with(run_id, '{prefix}') GROUP BY ALL) k
LEFT JOIN (SELECT run_id, count(*) AS n FROM discarded_rollouts WHERE starts_with(run_id, '{prefix}') GROUP BY ALL) d
USING (run_id) ORDER BY k.run_id
""".strip()

TOKENS = """
SELECT run_id, purpose, sum(calls) AS calls, sum(completions) AS completions, sum(tokens) AS tokens
FROM generated_tokens WHERE starts_with(run_id, '{prefix}') GROUP BY ALL ORDER BY run_id, purpose
""".strip()

# a run's wall time: each start (running, resumed) to the row after it (failed, completed, or the next start when
# a killed process left no row, so such a gap counts); a run still going has no row after its last start
RUNTIME = """
WITH marks AS (SELECT run_id, status, created_at,
                      lead(created_at) OVER (PARTITION BY run_id ORDER BY created_at) AS next_at FROM runs
               WHERE starts_with(run_id, '{prefix}'))
SELECT run_id, sum(epoch(next_at) - epoch(created_at)) AS seconds,
       count(*) AS starts FROM marks
WHERE status IN ('running', 'resumed') AND next_at IS NOT NULL GROUP BY run_id ORDER BY run_id
""".strip()


# the tokens each run's optimizer stepped on (train_steps.n_tokens: response tokens of its training rows)
TRAINED = """
SELECT run_id, count(*) AS steps, sum(n_tokens) AS train_tokens FROM train_steps
WHERE starts_with(run_id, '{prefix}') GROUP BY ALL ORDER BY run_id
""".strip()


# the budget governor's measurements: one row per run and component; a round counts where the component generated
# and plain rollouts have a yield to compare with (as the governor's own rule reads them)
YIELDS = """
WITH g AS (SELECT *, tokens > 0 AND baseline_per_1k IS NOT NULL AS measured FROM governor
           WHERE starts_with(run_id, '{prefix}'))
SELECT run_id, component, count(*) FILTER (WHERE measured) AS rounds_active,
       sum(tokens) FILTER (WHERE measured) AS tokens, sum(rows) FILTER (WHERE measured) AS rows,
       sum(yield_per_1k) FILTER (WHERE measured) AS yield_sum,
       sum(baseline_per_1k) FILTER (WHERE measured) AS baseline_sum,
       count(*) FILTER (WHERE measured AND yield_per_1k < baseline_per_1k) AS rounds_below,
       count(*) FILTER (WHERE throttled) AS rounds_throttled
FROM g GROUP BY ALL ORDER BY run_id, component
""".strip()


def query(name: str, prefix: str, split: str = "heldout") -> str:
    """The text of query `name` for runs whose ids start with `prefix`- (names are checked, so the text
    needs no escaping)."""
    check_name("run-id prefix", prefix)
    if split != "heldout":
        check_name("split", split.removeprefix("dataset:"))
    return {"CHECKPOINTS": CHECKPOINTS, "PASS": PASS, "GROUPS": GROUPS, "DISCARDED": DISCARDED,
            "TOKENS": TOKENS, "RUNTIME": RUNTIME, "TRAINED": TRAINED,
            "YIELDS": YIELDS}[name].format(prefix=f"{prefix}-", split=split)


def frame(store: Store, name: str, prefix: str, split: str = "heldout") -> pl.DataFrame:
    return pl.from_arrow(sql(store, query(name, prefix, split)))


@dataclass(frozen=True)
class RunCurve:
    """One run's evaluated checkpoints: their costs on each axis and per-prompt pass@1 [checkpoints, prompts]."""

    run_id: str
    versions: list[int]
    costs: dict[str, list[float]]
    pass1: np.ndarray
    prompt_ids: list[str]

    milestones: list[int | None] = ()  # per checkpoint: the generated-token milestone it was evaluated at

    def at(self, axis: str, budget: float) -> np.ndarray | None:
        return at_budget(self.costs[axis], self.pass1, budget)

    def last(self, axis: str) -> float:
        return self.costs[axis][-1]

    def last_milestone(self) -> float | None:
        """The largest milestone the run was evaluated at; None when it was evaluated every round."""
        marks = [m for m in self.milestones if m is not None]
        return float(max(marks)) if marks else None


def eval_token_share(tokens: pl.DataFrame) -> float:
    """Evaluation tokens over all generated tokens of a `TOKENS` frame (the comparison's runs)."""
    total = float(tokens["tokens"].sum())
    return float(tokens.filter(pl.col("purpose") == "eval")["tokens"].sum()) / total if total else 0.0


def run_curves(store: Store, prefix: str, run_ids: list[str], per_prompt: pl.DataFrame | None = None
               ) -> dict[str, RunCurve]:
    """The held-out curve of each run in `run_ids` (every one must have been evaluated); `per_prompt` is the
    `PASS` frame of the held-out split when the caller already has it."""
    points = frame(store, "CHECKPOINTS", prefix)
    per_prompt = frame(store, "PASS", prefix) if per_prompt is None else per_prompt
    out = {}
    for run_id in run_ids:
        pts = points.filter(pl.col("run_id") == run_id).sort("policy_version")
        if pts.height == 0:
            raise ValueError(f"run {run_id} has no held-out evaluation in the store (not run yet, or eval off)")
        rows = per_prompt.filter(pl.col("run_id") == run_id)
        wide = rows.pivot(on="prompt_id", index="policy_version", values="pass1").sort("policy_version")
        ids = sorted(c for c in wide.columns if c != "policy_version")
        matrix = wide.select(ids).to_numpy()
        if np.isnan(matrix).any():
            raise ValueError(f"run {run_id}: its checkpoints were evaluated on different held-out prompts")
        versions = pts["policy_version"].to_list()
        if versions[0] != 0:
            raise ValueError(f"run {run_id}: its base model (version 0) has no held-out evaluation")
        if wide["policy_version"].to_list() != versions:
            raise ValueError(f"run {run_id}: evaluated versions and checkpoints disagree")
        costs = {axis: [float(x) for x in pts[axis].to_list()] for axis in AXES}
        marks = pts["milestone"].to_list()
        costs["tokens"] = [float(m) if m is not None else t for m, t in zip(marks, costs["tokens"])]
        for axis in ("tokens", "steps"):  # seconds can only grow too, but a clock may step; tokens and steps must
            if np.any(np.diff(costs[axis]) < 0):
                raise ValueError(f"run {run_id}: {axis} decrease between checkpoints: {costs[axis]}")
        costs["seconds"] = list(np.maximum.accumulate(costs["seconds"]))
        out[run_id] = RunCurve(run_id, versions, costs, matrix, ids, marks)
    prompt_sets = {tuple(c.prompt_ids) for c in out.values()}
    if len(prompt_sets) > 1:
        raise ValueError("the runs hold out different prompts: compare runs of one pool and eval seed only")
    return out


def arm_at(curves: list[RunCurve], axis: str, budget: float) -> np.ndarray | None:
    """[seeds, prompts] pass@1 of an arm's runs at `budget` on `axis`; None if any run did not reach it."""
    rows = [c.at(axis, budget) for c in curves]
    if any(r is None for r in rows):
        return None
    return np.vstack(rows)
