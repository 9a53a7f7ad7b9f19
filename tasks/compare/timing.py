"""Seconds of generation and training per checkpoint, from the stages' commit records (issue 49, item 5).

The wall-clock axis of the comparison (tasks/compare/figures.py `CHECKPOINTS`) is a checkpoint's `created_at`
less the run's first start: it holds the held-out evaluations of earlier checkpoints, the reports, and any
time the run stood stopped before a resume. An arm with more, cheaper rounds pays more evaluation on it, and
one stopped run moves every arm's matched budget. The work-seconds axis counts only the work the arms differ
in: generating (the stages that land non-evaluation generated tokens: `collect` with LoPE and DAPO's
discards, `refine`'s teacher, `shape`'s MCMC proposals, `rescore`) and training (`train`).

A stage's seconds are read off the store's commit records (`_landed/…/<stage>.json`, `committed_at`;
storage/records.py), which `refinery sql` cannot see, so this is the one figure of the page without a printed
query. Walking a run's records in commit order, a record's seconds are its commit time less the previous
record's; records landed inside a stage (teacher answers as each returns, embeddings) pass their seconds on to
the stage record that follows them (a stage of another name that lands generated tokens, not an evaluation,
counts as generation); a run mark (`running-…`, `resumed-…`, `failed-…`, `completed-…`) starts the
count again, so the time a run stood stopped, and work lost to a crash, count nowhere. A checkpoint v's cost is
the work seconds of rounds 0..v-1, as its token cost is (the base model's is 0).
"""

from __future__ import annotations

from datetime import datetime

from storage.store import Store

WORK_STAGES = ("collect", "refine", "shape", "rescore", "train", "other generation")
MAIN_STAGES = ("pool", "select", "collect", "score", "refine", "shape", "train", "govern", "evaluate", "report",
               "rescore")
RUN_MARKS = ("running", "resumed", "failed", "completed")
GENERATING = "other generation"  # a stage outside MAIN_STAGES that lands generated tokens (not an evaluation)


def _generates(record: dict) -> bool:
    return "generated_tokens" in record.get("tables", {}) and not record["stage"].startswith("eval")


def stage_seconds(store: Store, run_ids: list[str]) -> dict[str, dict[int, dict[str, float]]]:
    """run_id -> round -> stage -> seconds, for the main stages of each run (records of other runs ignored)."""
    wanted = set(run_ids)
    by_run: dict[str, list[dict]] = {}
    for r in store.records():
        if r["run_id"] in wanted:
            by_run.setdefault(r["run_id"], []).append(r)
    out: dict[str, dict[int, dict[str, float]]] = {r: {} for r in run_ids}
    for run_id, recs in by_run.items():
        recs.sort(key=lambda r: r["committed_at"])
        prev, pending = None, 0.0
        for r in recs:
            t = datetime.fromisoformat(r["committed_at"]).timestamp()
            kind = r["stage"].split("-")[0]
            seconds = 0.0 if prev is None else max(0.0, t - prev)
            prev = t
            if kind in RUN_MARKS:
                pending = 0.0
            elif r["round"] is not None and (r["stage"] in MAIN_STAGES or _generates(r)):
                per_round = out[run_id].setdefault(int(r["round"]), {})
                name = r["stage"] if r["stage"] in MAIN_STAGES else GENERATING
                per_round[name] = per_round.get(name, 0.0) + pending + seconds
                pending = 0.0
            else:  # teacher answers, embeddings, an external evaluation: landed inside or beside a stage
                pending += seconds
    return out


def work_seconds(stages: dict[int, dict[str, float]], version: int) -> float:
    """Generation and training seconds of rounds 0..version-1 (the work before checkpoint `version`)."""
    return float(sum(s for rnd, per in stages.items() if rnd < version for st, s in per.items() if st in WORK_STAGES))
