"""The evaluate flow: held-out pass@1 / pass@k of one of a run's checkpoints (default: its newest).

It reuses the run's stored config (held-out split, sampling, verifier), so the numbers are comparable with
the curriculum flow's own per-round evaluations. The result lands in `evals` as stage `eval-v<version>` of
the checkpoint's round; evaluating the same version again reports the landed numbers instead of resampling.
"""

from __future__ import annotations

import polars as pl
from prefect import flow

from storage.query import scan
from storage.store import Store, default_root


def latest_run(store: Store) -> str:
    runs = scan(store, "runs").select("run_id", "created_at").collect()
    if runs.height == 0:
        raise ValueError(f"the store {store.uri} has no runs; start one with `refinery run`")
    return runs.sort("created_at")["run_id"][-1]


@flow(name="evaluate", validate_parameters=True)
def evaluate(run_id: str | None = None, checkpoint: int | None = None, store: str | None = None) -> dict:
    """Evaluate checkpoint `checkpoint` (a policy_version; default the newest) of run `run_id` (default the
    newest run) on the run's held-out split."""
    from flows.config import RunConfig
    from storage.checkpoints import checkpoint_versions
    from storage.runs import stored_config
    from tasks.evaluate import evaluate_versions
    from tasks.stage import RoundContext, skipped

    s = Store(store or default_root())
    run_id = run_id or latest_run(s)
    cfg = stored_config(s, run_id)
    if cfg is None:
        raise ValueError(f"run {run_id!r} is not in the store {s.uri}")
    config = RunConfig.model_validate(cfg)
    known = checkpoint_versions(s, run_id)
    if known.height == 0:
        known = pl.DataFrame({"policy_version": [0], "round": [0], "path": [config.model.policy]})
    if checkpoint is None:
        checkpoint = int(known["policy_version"].max())
    row = known.filter(pl.col("policy_version") == checkpoint)
    if row.height == 0:
        raise ValueError(f"run {run_id} has no checkpoint {checkpoint}; it has "
                         f"{', '.join(map(str, known['policy_version'].to_list()))}")
    r = row.row(0, named=True)
    stage = f"eval-v{checkpoint}"
    if s.landed(run_id, r["round"], stage):
        out = skipped(stage, r["round"])
    else:
        ctx = RoundContext(store=s.uri, run_id=run_id, round=r["round"], policy_version=checkpoint,
                           base=config.model.policy, rounds=config.rounds, model=config.model)
        out = evaluate_versions(s, ctx, [(checkpoint, r["path"])], config.eval, config.rollout, config.reward,
                                stage=stage)
    landed = (scan(s, "evals").filter((pl.col("run_id") == run_id) & (pl.col("policy_version") == checkpoint))
              .sort("round").collect())
    return {"run_id": run_id, "policy_version": checkpoint, "stage": out, "evals": landed.to_dicts()}
