"""The rescore flow: re-probe a completed run's reserve pool with its newest checkpoint (tasks/rescore.py).

prefect.yaml schedules it nightly. Without a run id it takes the store's newest `refinery run` run (imported
and sampler runs have no checkpoints of their own); a store with no such run yet is a no-op, so a schedule set
up before the first run does not fail every night. It holds the run's lock, so it never overlaps a curriculum
run of the same id.
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from storage.store import Store, default_root


class NothingToRescore(ValueError):
    """No run id given and the store has no run of `refinery run`: a no-op, not a failure."""


def rescore_target(s: Store, run_id: str | None):
    """(run id, its RunConfig) of the run to rescore (default the newest `refinery run` run), checked against
    the store: made by `refinery run` and completed (or live: the lock decides), else a one-line
    ValueError; NothingToRescore where no run id was given and there is none. `refinery rescore` calls it
    before Prefect's server is up, the flow again."""
    from flows.evaluate import latest_run, run_config
    from tasks.rescore import check_rescorable

    if run_id is None:
        try:
            run_id = latest_run(s)
        except ValueError as e:
            raise NothingToRescore(str(e)) from None
    config = run_config(s, run_id, "rescore with")
    check_rescorable(s, run_id, under_lock=False)  # the task checks again under the run's lock
    return run_id, config


@flow(name="rescore", validate_parameters=True)
def rescore(run_id: str | None = None, store: str | None = None) -> dict:
    """Re-score run `run_id`'s reserve prompts (default: the newest run) against its newest checkpoint; the
    ones with EPS > tau come back as active in the run's next round."""
    from storage.runs import run_lock
    from tasks.rescore import rescore_context, rescore_task

    s = Store(store or default_root())
    try:
        run_id, config = rescore_target(s, run_id)
    except NothingToRescore as e:
        get_run_logger().warning("nothing to rescore: %s", e)
        return {"stage": "rescore", "skipped": str(e)}
    with run_lock(s, run_id):
        out = rescore_task(rescore_context(s, run_id, config.model, config.scale), config.rollout, config.reward,
                           config.utility)
    if "skipped" not in out:
        get_run_logger().info("run %s round %s: rescored %d reserve prompts with v%d; %d come back as active",
                              run_id, out["round"], out["reserve"], out["policy_version"], out["reactivated"])
    return out
