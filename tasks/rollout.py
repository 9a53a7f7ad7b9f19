"""Collect stage: G samples per pool prompt from the current policy, verified and stored as `rollouts`.

Each prompt is the question plus the configured instruction, rendered with the model's chat template,
optionally after few-shot demonstrations (tasks/fewshot.py, recorded in `augmentation`). All-fail groups
are then resampled under Lorem-Ipsum prefixes (tasks/lope.py), and correct resamples replace up to G - 1
failures, also recorded in `augmentation`.
The whole round lands as one atomic stage; a crash mid-collection leaves nothing, and the rerun collects
the round again with the same seed (so exactly one set of rollouts per prompt and round exists).
"""

from __future__ import annotations

import time
from typing import Any

import polars as pl
import pyarrow as pa
from prefect import task

from models.backend import Sampling
from models.registry import load_backend
from storage.query import scan
from storage.store import Store, fault_point
from tasks.fewshot import demonstrations, fewshot_messages
from tasks.lope import Rescue, is_lope_replaced, lope_rescue
from tasks.reporting import progress_reporter, sig4, timed
from tasks.rewards import report_timeouts, verify


def round_prompts(store: Store, run_id: str, round: int, use_selection: bool, include_reserve: bool) -> pl.DataFrame:
    """The prompts this round collects for: its selection, or (selector 'all') the pool's active members,
    and reserve ones if asked."""
    this = (pl.col("run_id") == run_id) & (pl.col("round") == round)
    if use_selection:
        ids = scan(store, "selections").filter(this)
    else:
        statuses = ["active", "reserve"] if include_reserve else ["active"]
        ids = scan(store, "pool").filter(this & pl.col("status").is_in(statuses))
    prompts = (scan(store, "prompts").select("prompt_id", "text", "answer", "source", "meta", "root_id")  # root_id:
               .unique("prompt_id"))  # few-shot context keeps a prompt's own lineage out of its demonstrations
    return ids.select("prompt_id").unique().join(prompts, on="prompt_id", how="inner").sort("prompt_id").collect()


def _verify(row: dict, text: str, reward_cfg: Any):
    return verify(text, row["answer"], row["source"], row["text"], row["meta"], reward_cfg.verifier,
                  reward_cfg.strict, reward_cfg.format_weight)


def verdicts(prompts: pl.DataFrame, groups: list, reward_cfg: Any) -> list[list]:
    """The verifier's Verdict for every completion (per completion on purpose: each parses model text)."""
    return [[_verify(row, c.text, reward_cfg) for c in group]
            for row, group in zip(prompts.iter_rows(named=True), groups)]


def rollout_table(prompts: pl.DataFrame, groups: list, rendered: list[str], augmentation: list[list[str | None]],
                  checked: list[list], run_id: str, round: int, policy_version: int) -> pa.Table:
    cols: dict[str, list] = {k: [] for k in ("prompt_id", "sample_idx", "prompt_text", "completion", "reward",
                                             "correct", "n_tokens", "mean_logprob", "finish_reason",
                                             "augmentation", "verify_timeout")}
    for row, text, augs, group, vs in zip(prompts.iter_rows(named=True), rendered, augmentation, groups, checked):
        for i, (c, aug, v) in enumerate(zip(group, augs, vs)):
            for k, x in (("prompt_id", row["prompt_id"]), ("sample_idx", i), ("prompt_text", text),
                         ("completion", c.text), ("reward", v.reward), ("correct", v.correct),
                         ("n_tokens", c.n_tokens), ("mean_logprob", c.mean_logprob),
                         ("finish_reason", c.finish_reason), ("augmentation", aug),
                         ("verify_timeout", v.timed_out)):
                cols[k].append(x)
    n = len(cols["prompt_id"])
    cols["augmentation"] = pa.array(cols["augmentation"], pa.string())
    return pa.table({"run_id": [run_id] * n, "round": [round] * n, "policy_version": [policy_version] * n, **cols})


def collect(store: Store, run_id: str, round: int, policy_version: int, model_cfg: Any, rollout_cfg: Any,
            reward_cfg: Any, use_selection: bool = False, rounds: int = 1) -> dict:
    """Generate, verify and land the round's rollouts. Returns a small summary."""
    if store.landed(run_id, round, "collect"):
        return {"stage": "collect", "round": round, "skipped": "already landed"}
    prompts = round_prompts(store, run_id, round, use_selection, rollout_cfg.include_reserve)
    if prompts.height == 0:
        raise ValueError(f"run {run_id} round {round}: the pool has no prompt to collect for")
    backend = load_backend(model_cfg.policy, model_cfg.backend, model_cfg.device, model_cfg.dtype,
                           model_cfg.batch_size)
    demos = demonstrations(store, run_id, round) if rollout_cfg.fewshot_k else None
    messages, augmentation = fewshot_messages(prompts, demos if demos is not None else pl.DataFrame(), run_id,
                                              round, rounds, rollout_cfg.fewshot_p0, rollout_cfg.fewshot_k,
                                              rollout_cfg.instruction)
    rendered = [backend.render(m) for m in messages]
    sampling = Sampling(rollout_cfg.temperature, rollout_cfg.top_p, rollout_cfg.max_new_tokens,
                        seed=rollout_cfg.seed * 1000 + round)
    total = prompts.height * rollout_cfg.group_size
    t0 = time.perf_counter()
    with progress_reporter(f"round {round}: rollouts", total) as advance:
        def on_progress(k: int) -> None:
            advance(k)
            fault_point("collect:mid")  # test hook: a fault test kills the process here, mid-collection

        groups = backend.generate(rendered, rollout_cfg.group_size, sampling, progress=on_progress)
    seconds = time.perf_counter() - t0
    n_tokens = sum(c.n_tokens for g in groups for c in g)  # the sampling pass's own tokens (LoPE reported apart)
    checked = verdicts(prompts, groups, reward_cfg)
    timeouts = sum(v.timed_out for vs in checked for v in vs)
    augs = [[a] * len(g) for a, g in zip(augmentation, groups)]
    rescue = Rescue()
    if rollout_cfg.lope_prefixes and rollout_cfg.lope_samples:
        rows = prompts.to_dicts()
        seen: dict[tuple[int, str], Any] = {}  # each resample's verdict, reused for the ones that replace

        def verify_one(i: int, text: str):
            v = seen[(i, text)] = _verify(rows[i], text, reward_cfg)
            return v.reward, v.correct

        correct = [[v.correct for v in vs] for vs in checked]
        t1 = time.perf_counter()
        rescue = lope_rescue(backend, messages, correct, groups, augs, sampling, verify_one,
                             rollout_cfg.lope_prefixes, rollout_cfg.lope_samples, rollout_cfg.lope_max_groups)
        rescue.seconds = time.perf_counter() - t1
        for i, group in enumerate(groups):  # the replaced slots take their resample's verdict
            for j, c in enumerate(group):
                if (i, c.text) in seen and is_lope_replaced(augs[i][j]):
                    checked[i][j] = seen[(i, c.text)]
        timeouts += sum(v.timed_out for v in seen.values())
    table = rollout_table(prompts, groups, rendered, augs, checked, run_id, round, policy_version)
    store.commit("collect", {"rollouts": table}, run_id=run_id, round=round)
    report_timeouts("collect", round, timeouts)
    return {"stage": "collect", "round": round, "prompts": prompts.height, "rollouts": table.num_rows,
            "tokens": n_tokens, "seconds": sig4(seconds), "tokens_per_s": sig4(n_tokens / max(seconds, 1e-9)),
            "pass_rate": sig4(sum(table["correct"].to_pylist()) / max(table.num_rows, 1)),
            "verify_timeouts": timeouts,
            "lope": {"groups": rescue.groups, "rescued": rescue.rescued, "replaced": rescue.replaced,
                     "resamples": rescue.resamples, "seconds": sig4(rescue.seconds)}}


@task(name="collect")
@timed
def collect_task(store_uri: str, run_id: str, round: int, policy_version: int, model_cfg: Any, rollout_cfg: Any,
                 reward_cfg: Any, use_selection: bool = False, rounds: int = 1) -> dict:
    return collect(Store(store_uri), run_id, round, policy_version, model_cfg, rollout_cfg, reward_cfg, use_selection,
                   rounds)
