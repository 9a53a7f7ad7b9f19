"""The rescore flow: re-probe a completed run's reserve pool with its newest checkpoint (tasks/rescore.py).

prefect.yaml schedules it nightly. Without a run id it takes the store's newest `refinery run` run (imported
and sampler runs have no checkpoints of their own); a store with no such run yet is a no-op, so a schedule set
up before the first run does not fail every night. It holds the run's lock, so it never overlaps a curriculum
run of the same id.
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from storage.store import Store, default_root


@flow(name="rescore", validate_parameters=True)
def rescore(run_id: str | None = None, store: str | None = None) -> dict:
    """Re-score run `run_id`'s reserve prompts (default: the newest run) against its newest checkpoint; the
    ones with EPS > tau come back as active in the run's next round."""
    from flows.evaluate import latest_run, run_config
    from storage.runs import run_lock
    from tasks.rescore import rescore_task

    s = Store(store or default_root())
    if run_id is None:
        try:
            run_id = latest_run(s)
        except ValueError as e:
            get_run_logger().warning("nothing to rescore: %s", e)
            return {"stage": "rescore", "skipped": str(e)}
    config = run_config(s, run_id, "rescore with")
    with run_lock(s, run_id):
        out = rescore_task(s.uri, run_id, config.model, config.rollout, config.reward, config.utility,
                          config.scale)
    if "skipped" not in out:
        get_run_logger().info("run %s round %s: rescored %d reserve prompts with v%d; %d come back as active",
                              run_id, out["round"], out["reserve"], out["policy_version"], out["reactivated"])
    return out
