"""Held-out evaluation: pass@1 and pass@k of a policy version on the run's held-out prompts -> `evals`.

The held-out set is fixed when the run starts (round 0's pool): a `heldout_fraction` of the root prompts,
chosen by a hash of (eval seed, root_id), gets pool status 'heldout'. Held-out prompts are never selected,
collected for training, refined or shaped, and refinement only ever derives children from collected
prompts, so training and evaluation are disjoint by root_id.

Decoding (`decoding`): 'greedy' (the default) takes one sample per prompt at T = 0, so pass@1 is "correct or
not" and pass@k is pass@1 (rows record k = 1); 'sampled' takes `n_samples` at `temperature`, seeded, and pass@1
is the mean per-prompt share of correct samples, pass@k the unbiased estimator 1 - C(n - c, k) / C(n, k) (Chen
et al. 2021), averaged over prompts. Greedy costs one completion per prompt instead of n: at the evidence
comparison's scale (8 samples per prompt after every round) evaluation was 68% of all generated tokens. Prompts
are plain (no few-shot, no LoPE).

When (`milestone_tokens`, the curriculum flow decides with `due`): with M > 0 a round's new checkpoint is
evaluated when the run's generated tokens (evaluation excluded) first reach or cross a multiple of M in that
round, and at the run's end (its last round, or the last round the token budget allows: flows/curriculum.py
`budget_ends`, which counts as reaching the budget, so its `milestone` may exceed its `generated_tokens` by the
few tokens the fitted round came in short); the base model is milestone 0. With M = 0 every round's checkpoint is evaluated. Each `evals` row records its `milestone` (the
multiple k * M it reached, 0 for the base model; null at a run's end that reached none) and the run's
`generated_tokens` before it; with M = 0 both stay null, as rows were written before milestones (the round is
the milestone, and the comparison sums the rounds' tokens). Every checkpoint is kept (nothing prunes checkpoints), so a milestone's policy
can be evaluated again with `refinery eval`. The decision is a function of the store, so a run killed between
a milestone's training and its evaluation evaluates it on resume (the stage has not landed).

A run stored before these fields existed ran 'sampled' after every round: `EvalConfig.absent_means` gives a
stored config without them those values (flows/config.py `stored_base`), so resuming it does not switch.

Reuse (`reuse_base`, greedy only): the base model's held-out evaluation is the same computation in every run of
a store with the same model section, prompts, instruction, longest completion and verifier (its `plan_key`);
a run copies the rows of the first run that landed it (`evals.reused_from`) and generates nothing for it
(storage/evals.py). A stored config without the field does not reuse.

Each evaluation lands one `evals` row (the means) and one `eval_results` row per prompt (samples, correct
ones, generated tokens), so intervals can resample prompts and tokens per correct answer can be counted. The
split is `heldout` for the run's own held-out prompts, `dataset:<name>` for a prompt file evaluated with
`refinery eval --dataset` (flows/evaluate.py).

One stage serves both callers (`evaluate_task`): the curriculum's evaluation of a round lands as `evaluate`;
`refinery eval` of one checkpoint (a `split` given) as `eval-v<version>` or `eval-v<version>-<name>-<digest>`
(`checkpoint_stage`), a name the stage contract computes from the call (tasks/stage.py), so a landed one is
skipped. Only the round's evaluation counts its tokens into the run's `generated_tokens` (models/meter.py).
Sampling is the shared generate-and-verify pass (tasks/sampling/verified.py).

A version's held-out numbers land once: the curriculum's evaluate stage and `refinery eval` both report the
rows that landed already (under any stage) instead of sampling that version again. The run's config and seeds
would draw the same samples, and a second identical row would count twice in SQL over `evals`. This covers a
run whose policy did not change in a round (training off: version 0 every round) and `refinery eval` of a
stopped run's checkpoint before the run resumes.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import polars as pl
import pyarrow as pa
from pydantic import Field

from models.config import Section
from models.registry import release_model
from models.sharded import load_generator
from storage.evals import reusable_evaluation
from storage.query import scan
from storage.rounds import prompts, this_round
from storage.schemas import schema
from storage.store import Store
from tasks.core.heldout import pass_at_k
from tasks.core.ids import digest
from tasks.core.rewards import RewardConfig
from tasks.reporting.progress import report_timeouts, sig4
from tasks.sampling.rollouts import RolloutConfig
from tasks.sampling.verified import config_sampling, generate_verified, plain_messages
from tasks.stage import RoundContext, stage


class EvalConfig(Section):
    """Held-out evaluation of every checkpoint."""

    enabled: bool = Field(True, description="score every new checkpoint on the held-out prompts")
    heldout_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="share of the round-0 pool's root "
                                    "prompts held out; never selected, refined or trained on")
    heldout_split: Literal["stratified", "flat"] = Field("stratified", description="stratified: commutative "
                                                         "twins together, each pool source entry holds out its "
                                                         "share (tasks/core/heldout.py); flat: a hash of the roots")
    decoding: Literal["greedy", "sampled"] = Field("greedy", description="greedy: one sample per prompt at "
                                                   "T = 0 (pass@1 = correct or not); sampled: n_samples at "
                                                   "`temperature`, pass@1 and pass@k")
    milestone_tokens: int = Field(0, ge=0, description="evaluate when the run's generated tokens (evaluation "
                                  "excluded) first reach each multiple of this, and at the run's end; 0: "
                                  "after every round")
    n_samples: int = Field(4, ge=1, le=1024, description="samples per held-out prompt (decoding 'sampled')")
    k: int = Field(4, ge=1, le=1024, description="pass@k (k <= n_samples; decoding 'sampled')")
    temperature: float = Field(0.7, ge=0.0, le=2.0, description="sampling temperature of the evaluation "
                               "(decoding 'sampled')")
    seed: int = Field(0, ge=0, description="evaluation sampling seed (version v samples with seed * 1000 + v); "
                      "also picks the held-out prompts")
    reuse_base: bool = Field(True, description="greedy decoding: copy the base model's held-out evaluation "
                             "from another run of the store that computed the same one, instead of generating "
                             "it again (storage/evals.py)")

    # what a stored config without these fields ran with (flows/config.py `stored_base` fills them in)
    absent_means: ClassVar[dict] = {"decoding": "sampled", "milestone_tokens": 0, "heldout_split": "flat",
                                    "reuse_base": False}

    def plan(self) -> tuple[int, int, float]:
        """(samples per prompt, k, temperature) of this decoding."""
        return (1, 1, 0.0) if self.decoding == "greedy" else (self.n_samples, self.k, self.temperature)


def milestone_reached(before: int, after: int, every: int) -> int | None:
    """The milestone a round first reaches, going from `before` to `after` generated tokens: the largest
    multiple of `every` in (before, after], or None (none, or every = 0).

    >>> milestone_reached(9_000, 12_000, 10_000), milestone_reached(10_000, 19_999, 10_000)
    (10000, None)
    >>> milestone_reached(9_000, 31_000, 10_000)
    30000
    """
    if every <= 0:
        return None
    top = after // every * every
    return top if top > before else None


def due(cfg: EvalConfig, before: int, after: int, last: bool) -> tuple[bool, int | None]:
    """Whether a round that took the run from `before` to `after` generated tokens evaluates its checkpoint,
    and the milestone it records: every round with milestone_tokens 0, else a round that reaches a milestone
    or ends the run."""
    mark = milestone_reached(before, after, cfg.milestone_tokens)
    return cfg.milestone_tokens == 0 or mark is not None or last, mark


def heldout_prompts(store: Store, run_id: str) -> pl.DataFrame:
    """The run's held-out prompts (fixed at round 0)."""
    ids = this_round(store, "pool", run_id, 0).filter(pl.col("status") == "heldout").select("prompt_id")
    return ids.join(prompts(store, "text", "answer", "source", "meta"), on="prompt_id").sort("prompt_id").collect()


def landed_heldout(store: Store, run_id: str, versions: list[int]) -> dict[int, dict]:
    """The `evals` rows already landed on the held-out split for these versions of the run, by version."""
    mine = (pl.col("run_id") == run_id) & pl.col("policy_version").is_in(versions) & (pl.col("split") == "heldout")
    return {r["policy_version"]: r for r in scan(store, "evals").filter(mine).collect().to_dicts()}


def summary_numbers(row: dict) -> dict:
    """A version's pass@1 and pass@k as the stage summaries print them."""
    return {"pass_at_1": sig4(row["pass_at_1"]), f"pass_at_{row['k']}": sig4(row["pass_at_k"])}


def evaluate_versions(store: Store, ctx: RoundContext, versions: list[tuple[int, str]], cfg: EvalConfig,
                      rollout_cfg: RolloutConfig, reward_cfg: RewardConfig, stage: str = "evaluate",
                      prompts: pl.DataFrame | None = None, split: str = "heldout",
                      at: dict[int, tuple[int | None, int | None]] | None = None) -> dict:
    """Evaluate each (policy_version, model spec) on `prompts` (prompt_id, text, answer, source, meta; default
    the run's held-out split); land one `evals` row per version and one `eval_results` row per version and
    prompt under `split`, as stage `stage` of ctx's round (the caller checks whether it already landed).
    `at` gives a version's (milestone, generated tokens before it) for its `evals` row (default null)."""
    if prompts is None:
        prompts = heldout_prompts(store, ctx.run_id)
        if prompts.height == 0:
            raise ValueError(f"run {ctx.run_id} has no held-out prompts (eval.heldout_fraction was 0, or the run "
                             "predates held-out splits)")
    rows, per_prompt, timeouts = [], [], 0
    n, k, temperature = cfg.plan()
    for version, spec in versions:
        model = ctx.model.model_copy(update={"policy": spec})
        key = (plan_key(model.model_dump_json(), rollout_cfg, reward_cfg, prompts)
               if version == 0 and split == "heldout" and cfg.decoding == "greedy" else None)
        reused = reusable_evaluation(store, key, ctx.run_id) if key and cfg.reuse_base else None
        if reused is None:
            backend = load_generator(model, ctx.scale)
            got = generate_verified(backend, prompts, plain_messages(prompts, rollout_cfg.instruction), n,
                                    config_sampling(rollout_cfg, version, seed=cfg.seed, temperature=temperature,
                                                    top_p=1.0), reward_cfg, "eval")
            timeouts += got.timeouts
            results = [(pid, len(g), sum(v.correct for v in vs), sum(c.n_tokens for c in g))
                       for pid, g, vs in zip(prompts["prompt_id"], got.groups, got.checked)]
            if spec != versions[-1][1]:  # the last version is the one the next round samples: only it stays loaded
                del backend
                release_model(model)
        else:
            results = list(reused[1].select("prompt_id", "n_samples", "n_correct", "n_tokens").iter_rows())
        per_prompt += [{"run_id": ctx.run_id, "round": ctx.round, "policy_version": version, "split": split,
                        "prompt_id": pid, "n_samples": m, "n_correct": c, "n_tokens": t} for pid, m, c, t in results]
        p1 = [c / m for _, m, c, _ in results]
        pk = [pass_at_k(m, c, k) for _, m, c, _ in results]
        rows.append({"run_id": ctx.run_id, "round": ctx.round, "policy_version": version, "split": split,
                     "n_prompts": prompts.height, "k": k, "pass_at_1": sum(p1) / len(p1),
                     "pass_at_k": sum(pk) / len(pk), "milestone": (at or {}).get(version, (None, None))[0],
                     "generated_tokens": (at or {}).get(version, (None, None))[1], "plan_key": key,
                     "reused_from": reused[0] if reused else None})
    store.commit(stage, {"evals": pa.Table.from_pylist(rows, schema=schema("evals")),
                         "eval_results": pa.Table.from_pylist(per_prompt, schema=schema("eval_results"))},
                 run_id=ctx.run_id, round=ctx.round)
    report_timeouts(stage, ctx.round, timeouts)
    return {"stage": stage, "round": ctx.round, "prompts": prompts.height, "verify_timeouts": timeouts,
            "versions": {r["policy_version"]: summary_numbers(r) for r in rows}}


def plan_key(model_json: str, rollout_cfg: RolloutConfig, reward_cfg: RewardConfig, prompts: pl.DataFrame) -> str:
    """A digest of what a greedy evaluation computes: the model section (policy spec, backend, dtype), the
    instruction and longest completion, the verifier's settings and the prompts (ids name their text and
    answer). Two runs with one key land the same rows (storage/evals.py)."""
    parts = [model_json, rollout_cfg.instruction, str(rollout_cfg.max_new_tokens), reward_cfg.model_dump_json(),
             *sorted(prompts["prompt_id"].to_list())]
    return digest(chr(31).join(parts))


def checkpoint_stage(version: int, split: str, prompts: pl.DataFrame | None = None) -> str:
    """The commit of `refinery eval` of one checkpoint: `eval-v<version>` on the held-out split,
    `eval-v<version>-<name>-<digest of its prompt ids>` on split `dataset:<name>` (flows/evaluate.py)."""
    if split == "heldout":
        return f"eval-v{version}"
    ids = sorted(set(prompts["prompt_id"])) if prompts is not None else []
    return f"eval-v{version}-{split.removeprefix('dataset:')}-{digest(chr(31).join(ids))[:8]}"


def evaluation_stage(ctx: RoundContext, versions: list[tuple[int, str]], split: str | None = None,
                     prompts: pl.DataFrame | None = None, **_) -> str:
    """The commit of an evaluation: `evaluate`, a round's own (no `split`), else `checkpoint_stage`."""
    return "evaluate" if split is None else checkpoint_stage(versions[0][0], split, prompts)


# `refinery eval` (a split given) stays out of the run's generated_tokens (its budget), as it always has
@stage(evaluation_stage, metered=lambda split=None, **_: split is None)
def evaluate_task(ctx: RoundContext, store: Store, versions: list[tuple[int, str]], cfg: EvalConfig,
                  rollout_cfg: RolloutConfig, reward_cfg: RewardConfig,
                  at: dict[int, tuple[int | None, int | None]] | None = None, split: str | None = None,
                  prompts: pl.DataFrame | None = None) -> dict:
    """The held-out evaluation of the round's new checkpoint (and, in round 0, the base model); `at`: each
    version's (milestone, generated tokens before it). A version whose held-out numbers landed already is
    reported, not sampled again (the stage lands what is new: maybe nothing).

    With `split` (`heldout`, or `dataset:<name>` with its `prompts`), `refinery eval` of one checkpoint
    (versions = [(version, its stored path)]) as stage `checkpoint_stage`: held-out numbers that landed
    already (under any stage) are reported by the flow, and nothing lands."""
    if split is not None:
        (version, path), = versions
        if split == "heldout" and landed_heldout(store, ctx.run_id, [version]):
            return {"skipped": "held-out numbers landed already"}
        from models.checkpoints import local_copy

        return evaluate_versions(store, ctx, [(version, local_copy(store, path))], cfg, rollout_cfg, reward_cfg,
                                 stage=checkpoint_stage(version, split, prompts), prompts=prompts, split=split)
    landed = landed_heldout(store, ctx.run_id, [v for v, _ in versions])
    out = evaluate_versions(store, ctx, [(v, spec) for v, spec in versions if v not in landed], cfg, rollout_cfg,
                            reward_cfg, at=at)
    if landed:
        out["versions"] = {**{v: summary_numbers(r) for v, r in sorted(landed.items())}, **out["versions"]}
        out["reported"] = sorted(landed)
    return out
