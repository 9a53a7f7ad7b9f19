"""Collect stage: G samples per pool prompt from the current policy, verified and stored as `rollouts`.

Each prompt is the question plus the configured instruction, rendered with the model's chat template,
optionally after few-shot demonstrations (tasks/fewshot.py, recorded in `augmentation`). All-fail groups
are then resampled under Lorem-Ipsum prefixes (tasks/core/lope.py), and correct resamples replace up to G - 1
failures, also recorded in `augmentation`.
With selector dapo_filter the round over-samples instead (DAPO dynamic sampling, tasks/core/dapo.py): groups
are generated batch by batch until B of them have reward variance; only those land as `rollouts`, every
other group generated lands in `discarded_rollouts`, and the refill prompts are added to `selections`.
The whole round lands as one atomic stage; a crash mid-collection leaves nothing, and the rerun collects
the round again with the same seed (so exactly one set of rollouts per prompt and round exists).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import polars as pl
import pyarrow as pa
from prefect import task
from pydantic import Field

from models.backend import Sampling
from models.config import Section
from models.registry import load_backend
from storage.query import scan
from storage.store import Store, fault_point
from tasks.core.dapo import SURPLUS, ZERO_VARIANCE, draw_order, dynamic_sampling
from tasks.core.lope import Rescue, is_lope_replaced, lope_rescue
from tasks.core.rewards import report_timeouts, verify
from tasks.fewshot import demonstrations, fewshot_messages
from tasks.reporting import progress_reporter, sig4, timed


class RolloutConfig(Section):
    group_size: int = Field(8, ge=2, le=256, description="G: samples per prompt")
    temperature: float = Field(0.7, ge=0.0, le=2.0, description="sampling temperature of rollouts (0: greedy)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling: keep the smallest token set with "
                         "this much probability (1: off)")
    max_new_tokens: int = Field(64, ge=1, le=8192, description="longest completion, in tokens")
    seed: int = Field(0, ge=0, description="sampling seed; round r uses seed * 1000 + r")
    instruction: str = Field("Put your final answer within \\boxed{}.",
                             description="appended to every question before the chat template")
    fewshot_p0: float = Field(0.5, ge=0.0, le=1.0, description="CBRL: p_t = p0 * (1 - t/T) of few-shot context")
    fewshot_k: int = Field(2, ge=0, le=16, description="CBRL: solved sibling demonstrations per prompt (0: off)")
    lope_prefixes: int = Field(6, ge=0, le=64, description="LoPE: Lorem-Ipsum system prefixes per all-fail "
                               "group (0: off)")
    lope_samples: int = Field(4, ge=0, le=64, description="LoPE: resamples per prefix")
    lope_max_groups: int = Field(4, ge=0, le=1_000_000, description="LoPE: all-fail groups resampled per round")
    include_reserve: bool = Field(False, description="reserve prompts are candidates too (default: only the "
                                  "rescore flow re-probes them)")


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


def _sample(backend: Any, prompts: pl.DataFrame, demos: pl.DataFrame | None, run_id: str, round: int, rounds: int,
            rollout_cfg: Any, sampling: Sampling, label: str) -> tuple[list, list, list[str], list]:
    """(chat messages, augmentation records, rendered prompts, G completions each) for `prompts`."""
    messages, augmentation = fewshot_messages(prompts, demos if demos is not None else pl.DataFrame(), run_id,
                                              round, rounds, rollout_cfg.fewshot_p0, rollout_cfg.fewshot_k,
                                              rollout_cfg.instruction)
    rendered = [backend.render(m) for m in messages]
    with progress_reporter(label, prompts.height * rollout_cfg.group_size) as advance:
        def on_progress(k: int) -> None:
            advance(k)
            fault_point("collect:mid")  # test hook: a fault test kills the process here, mid-collection

        groups = backend.generate(rendered, rollout_cfg.group_size, sampling, progress=on_progress)
    return messages, augmentation, rendered, groups


DAPO_SEED_STRIDE = 1_000_003  # refill k of a round samples with seed + k * this: fresh noise, no other round's seed


def _in_order(frame: pl.DataFrame, ids: list[str]) -> pl.DataFrame:
    """The rows of `frame` for `ids`, in that order."""
    order = pl.DataFrame({"prompt_id": ids, "_order": list(range(len(ids)))}, schema={"prompt_id": pl.String,
                                                                                       "_order": pl.Int64})
    return frame.join(order, on="prompt_id").sort("_order").drop("_order")


def _dynamic_sampling(store: Store, run_id: str, round: int, policy_version: int, first: pl.DataFrame,
                      backend: Any, demos: pl.DataFrame | None, rounds: int, rollout_cfg: Any, reward_cfg: Any,
                      select_cfg: Any, sampling: Sampling) -> tuple:
    """DAPO dynamic sampling (tasks/core/dapo.py) over the round's candidates: the select stage's draw (`first`)
    is generation batch 1; refills come from the rest of the pool in a seeded uniform order. Returns the kept
    groups as collect's usual lists, plus the summary and the extra tables to land with the rollouts:
    `discarded_rollouts` (every group generated and not kept) and `selections` rows for the refills, so that
    `selections` names every prompt generated for and each has its group in exactly one of the two tables."""
    candidates = round_prompts(store, run_id, round, False, rollout_cfg.include_reserve)
    chosen = set(first["prompt_id"].to_list())
    order = draw_order(candidates["prompt_id"].to_list(), select_cfg.seed * 1000 + round)
    queue = [i for i in order if i in chosen] + [i for i in order if i not in chosen]
    spent = {"seconds": 0.0}

    def generate(ids: list[str], k: int) -> list[tuple]:
        rows = _in_order(candidates, ids)
        t0 = time.perf_counter()
        label = f"round {round}: rollouts" + (f" (dapo refill {k})" if k else "")
        messages, augmentation, rendered, groups = _sample(
            backend, rows, demos, run_id, round, rounds, rollout_cfg,
            replace(sampling, seed=sampling.seed + k * DAPO_SEED_STRIDE), label)
        spent["seconds"] += time.perf_counter() - t0
        checked = verdicts(rows, groups, reward_cfg)
        return list(zip(rows.iter_rows(named=True), messages, augmentation, rendered, groups, checked))

    out = dynamic_sampling(queue, select_cfg.batch_size, select_cfg.dapo_oversample, select_cfg.dapo_max_batches,
                           generate, rewards=lambda g: [v.reward for v in g[5]], first_size=len(chosen))
    kept = sorted(out.kept, key=lambda d: d.item)  # the usual order of a round's rollouts: by prompt_id
    prompts = _in_order(candidates, [d.item for d in kept])
    messages, augmentation, rendered, groups, checked = ([d.group[j] for d in kept] for j in range(1, 6))
    gone = out.discarded
    table = rollout_table(_in_order(candidates, [d.item for d in gone]), [d.group[4] for d in gone],
                          [d.group[3] for d in gone], [[d.group[2]] * len(d.group[4]) for d in gone],
                          [d.group[5] for d in gone], run_id, round, policy_version)
    per_row = [(d.gen_batch, d.reason) for d in gone for _ in d.group[4]]
    table = table.append_column("gen_batch", pa.array([b for b, _ in per_row], pa.int32())).append_column(
        "reason", pa.array([r for _, r in per_row], pa.string()))
    refills = [d for d in out.kept + out.discarded if d.gen_batch > 0]
    extra = {"discarded_rollouts": table} if table.num_rows else {}
    if refills:
        extra["selections"] = pa.table({
            "run_id": [run_id] * len(refills), "round": pa.array([round] * len(refills), pa.int32()),
            "prompt_id": [d.item for d in refills], "selector": ["dapo_filter"] * len(refills),
            "reason": [f"dapo_filter: generation batch {d.gen_batch + 1} (refill)" for d in refills]})
    drawn = out.kept + out.discarded
    n_tokens = sum(c.n_tokens for d in drawn for c in d.group[4])  # everything generated is spent
    timeouts = sum(v.timed_out for d in drawn for v in d.group[5])
    summary = {"batch_size": out.batch, "generation_batches": out.batches, "groups_generated": out.generated,
               "kept": len(out.kept), "discarded_groups": len(gone),
               "zero_variance": sum(d.reason == ZERO_VARIANCE for d in gone),
               "surplus": sum(d.reason == SURPLUS for d in gone), "discarded_rollouts": table.num_rows,
               "discarded_tokens": int(sum(table["n_tokens"].to_pylist())), "short": out.short,
               "cap_hit": out.cap_hit, "exhausted": out.exhausted, "max_batches": select_cfg.dapo_max_batches}
    return (prompts, messages, augmentation, rendered, groups, checked, spent["seconds"], n_tokens, timeouts,
            summary, extra)


def collect(store: Store, run_id: str, round: int, policy_version: int, model_cfg: Any, rollout_cfg: Any,
            reward_cfg: Any, use_selection: bool = False, rounds: int = 1, select_cfg: Any = None) -> dict:
    """Generate, verify and land the round's rollouts. Returns a small summary. With selector dapo_filter
    (`select_cfg`), DAPO dynamic sampling decides which groups are the round's rollouts (_dynamic_sampling)."""
    if store.landed(run_id, round, "collect"):
        return {"stage": "collect", "round": round, "skipped": "already landed"}
    prompts = round_prompts(store, run_id, round, use_selection, rollout_cfg.include_reserve)
    if prompts.height == 0:
        raise ValueError(f"run {run_id} round {round}: the pool has no prompt to collect for")
    backend = load_backend(model_cfg.policy, model_cfg.backend, model_cfg.device, model_cfg.dtype,
                           model_cfg.batch_size)
    demos = demonstrations(store, run_id, round) if rollout_cfg.fewshot_k else None
    sampling = Sampling(rollout_cfg.temperature, rollout_cfg.top_p, rollout_cfg.max_new_tokens,
                        seed=rollout_cfg.seed * 1000 + round)
    dapo, landed_too = None, {}
    if select_cfg is not None and select_cfg.selector == "dapo_filter":
        (prompts, messages, augmentation, rendered, groups, checked, seconds, n_tokens, timeouts, dapo,
         landed_too) = _dynamic_sampling(store, run_id, round, policy_version, prompts, backend, demos, rounds,
                                         rollout_cfg, reward_cfg, select_cfg, sampling)
    else:
        t0 = time.perf_counter()
        messages, augmentation, rendered, groups = _sample(backend, prompts, demos, run_id, round, rounds,
                                                           rollout_cfg, sampling, f"round {round}: rollouts")
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
                             rollout_cfg.lope_prefixes, rollout_cfg.lope_samples, rollout_cfg.lope_max_groups,
                             own_rewards=[[v.reward for v in vs] for vs in checked])  # scoring reads these
        rescue.seconds = time.perf_counter() - t1
        for i, group in enumerate(groups):  # the replaced slots take their resample's verdict
            for j, c in enumerate(group):
                if (i, c.text) in seen and is_lope_replaced(augs[i][j]):
                    checked[i][j] = seen[(i, c.text)]
        timeouts += sum(v.timed_out for v in seen.values())
    table = rollout_table(prompts, groups, rendered, augs, checked, run_id, round, policy_version)
    store.commit("collect", {"rollouts": table, **landed_too}, run_id=run_id, round=round)
    report_timeouts("collect", round, timeouts)
    return {"stage": "collect", "round": round, "prompts": prompts.height, "rollouts": table.num_rows,
            "tokens": n_tokens, "seconds": sig4(seconds), "tokens_per_s": sig4(n_tokens / max(seconds, 1e-9)),
            "pass_rate": sig4(sum(table["correct"].to_pylist()) / max(table.num_rows, 1)),
            "verify_timeouts": timeouts,
            "lope": {"groups": rescue.groups, "rescued": rescue.rescued, "replaced": rescue.replaced,
                     "resamples": rescue.resamples, "seconds": sig4(rescue.seconds)},
            **({"dapo": dapo} if dapo is not None else {})}


@task(name="collect")
@timed
def collect_task(store_uri: str, run_id: str, round: int, policy_version: int, model_cfg: Any, rollout_cfg: Any,
                 reward_cfg: Any, use_selection: bool = False, rounds: int = 1, select_cfg: Any = None) -> dict:
    return collect(Store(store_uri), run_id, round, policy_version, model_cfg, rollout_cfg, reward_cfg, use_selection,
                   rounds, select_cfg)
