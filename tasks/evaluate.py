"""Held-out evaluation: pass@1 and pass@k of a policy version on the run's held-out prompts -> `evals`.

The held-out set is fixed when the run starts (round 0's pool): a `heldout_fraction` of the root prompts,
chosen by a hash of (eval seed, root_id), gets pool status 'heldout'. Held-out prompts are never selected,
collected for training, refined or shaped, and refinement only ever derives children from collected
prompts, so training and evaluation are disjoint by root_id.

pass@1 is the mean per-prompt share of correct samples; pass@k is the unbiased estimator
1 - C(n - c, k) / C(n, k) (Chen et al. 2021), averaged over prompts. Samples are plain prompts (no few-shot,
no LoPE), at the eval temperature, seeded.
"""

from __future__ import annotations

import hashlib
from math import comb
from typing import Any

import polars as pl
import pyarrow as pa
from prefect import task
from pydantic import Field

from models.backend import Sampling
from models.config import Section
from storage.query import scan
from storage.store import Store
from tasks.reporting import sig4, timed


class EvalConfig(Section):
    """Held-out evaluation of every checkpoint."""

    enabled: bool = Field(True, description="score every new checkpoint on the held-out prompts")
    heldout_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="share of the round-0 pool's root "
                                    "prompts held out; never selected, refined or trained on")
    n_samples: int = Field(4, ge=1, le=1024, description="samples per held-out prompt")
    k: int = Field(4, ge=1, le=1024, description="pass@k (k <= n_samples)")
    temperature: float = Field(0.7, ge=0.0, le=2.0, description="sampling temperature of the evaluation")
    seed: int = Field(0, ge=0, description="evaluation sampling seed; also picks the held-out prompts")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct.

    >>> pass_at_k(4, 0, 2), pass_at_k(4, 4, 2), round(pass_at_k(4, 1, 2), 4)
    (0.0, 1.0, 0.5)
    """
    if k > n:
        raise ValueError(f"pass@{k} needs at least k samples, got n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def heldout_roots(root_ids: list[str], fraction: float, seed: int) -> set[str]:
    """round(fraction * n) roots (at least one, and never all when n > 1), chosen by a seeded hash."""
    roots = sorted(set(root_ids))
    if not roots or fraction <= 0:
        return set()
    n = min(max(1, round(fraction * len(roots))), max(1, len(roots) - 1))
    ranked = sorted(roots, key=lambda r: hashlib.sha256(f"{seed}\x1f{r}".encode()).hexdigest())
    return set(ranked[:n])


def heldout_prompts(store: Store, run_id: str) -> pl.DataFrame:
    """The run's held-out prompts (fixed at round 0)."""
    ids = scan(store, "pool").filter((pl.col("run_id") == run_id) & (pl.col("round") == 0)
                                     & (pl.col("status") == "heldout")).select("prompt_id")
    prompts = scan(store, "prompts").select("prompt_id", "text", "answer", "source", "meta").unique("prompt_id")
    return ids.join(prompts, on="prompt_id").sort("prompt_id").collect()


def evaluate_versions(store: Store, run_id: str, round: int, versions: list[tuple[int, str]], cfg: Any,
                      model_cfg: Any, rollout_cfg: Any, reward_cfg: Any, stage: str = "evaluate") -> dict:
    """Evaluate each (policy_version, model spec) on the held-out split; land one `evals` row per version."""
    from models.registry import load_backend
    from tasks.core.rewards import report_timeouts, verify

    if store.landed(run_id, round, stage):
        return {"stage": stage, "round": round, "skipped": "already landed"}
    prompts = heldout_prompts(store, run_id)
    if prompts.height == 0:
        raise ValueError(f"run {run_id} has no held-out prompts (eval.heldout_fraction was 0, or the run predates "
                         "held-out splits)")
    rows, timeouts = [], 0
    for version, spec in versions:
        backend = load_backend(spec, model_cfg.backend, model_cfg.device, model_cfg.dtype, model_cfg.batch_size)
        rendered = [backend.render([{"role": "user", "content": f"{t}\n{rollout_cfg.instruction}".strip()}])
                    for t in prompts["text"]]
        groups = backend.generate(rendered, cfg.n_samples, Sampling(cfg.temperature, 1.0, rollout_cfg.max_new_tokens,
                                                                    cfg.seed * 1000 + version))
        p1, pk = [], []
        for row, group in zip(prompts.iter_rows(named=True), groups):
            checked = [verify(g.text, row["answer"], row["source"], row["text"], row["meta"], reward_cfg.verifier,
                              reward_cfg.strict, reward_cfg.format_weight) for g in group]
            c = sum(v.correct for v in checked)
            timeouts += sum(v.timed_out for v in checked)
            p1.append(c / len(group))
            pk.append(pass_at_k(len(group), c, cfg.k))
        rows.append({"run_id": run_id, "round": round, "policy_version": version, "split": "heldout",
                     "n_prompts": prompts.height, "k": cfg.k, "pass_at_1": sum(p1) / len(p1),
                     "pass_at_k": sum(pk) / len(pk)})
    store.commit(stage, {"evals": pa.Table.from_pylist(rows)}, run_id=run_id, round=round)
    report_timeouts(stage, round, timeouts)
    return {"stage": stage, "round": round, "prompts": prompts.height, "verify_timeouts": timeouts,
            "versions": {r["policy_version"]: {"pass_at_1": sig4(r["pass_at_1"]), f"pass_at_{cfg.k}": sig4(r["pass_at_k"])}
                         for r in rows}}


@task(name="evaluate")
@timed
def evaluate_task(store_uri: str, run_id: str, round: int, versions: list[tuple[int, str]], cfg: Any, model_cfg: Any,
                  rollout_cfg: Any, reward_cfg: Any) -> dict:
    return evaluate_versions(Store(store_uri), run_id, round, versions, cfg, model_cfg, rollout_cfg, reward_cfg)
