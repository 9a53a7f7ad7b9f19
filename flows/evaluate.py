"""The evaluate flow: held-out pass@1 / pass@k of one of a run's checkpoints (default: its newest).

It reuses the run's stored config (held-out split, decoding, verifier), so the numbers are comparable with
the curriculum flow's own evaluations (its `evals` rows leave milestone and generated_tokens null). The result
lands in `evals` as stage `eval-v<version>` of the checkpoint's round, through the evaluate stage
(tasks/evaluate.py `evaluate_task` with a split), which skips a landed one. A version whose held-out numbers
have landed already (the curriculum's own evaluation of it, stage `evaluate`, or an earlier `eval`) reports
those numbers instead of resampling: the same config and seeds would draw the same samples, and a second
identical row would count twice in SQL over `evals`.

`dataset` (a .jsonl or .parquet prompt file, the ingest schema: question, answer, optional id, solution, meta)
evaluates on that file instead of the held-out split, for sets the run never saw (data/external holds one).
Its rows are validated as ingest validates them (any bad row: nothing lands, one line per bad row) and land in
`prompts` like any ingest, with `source` = the dataset's name, so `eval_results` rows join to their text. The
name (`dataset_name`, default the file's stem) is the split, `dataset:<name>`; the stage is
`eval-v<version>-<name>-<content digest>`, so the same file evaluated again reports what landed, and another
file under a name that already has results in that run (any checkpoint) is refused before anything lands,
instead of being mixed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import polars as pl
from prefect import flow

from storage.query import scan
from storage.store import Store, default_root

if TYPE_CHECKING:
    from flows.config import RunConfig


def made_by(config: dict) -> str | None:
    """Who made a run that `refinery run` did not (its stored config says so), else None."""
    if "imported" in config:
        return "`refinery import`"
    if "sampler" in config:
        return "an external loop's sampler (flows/sampler.py)"
    return None


def latest_run(store: Store) -> str:
    """The newest run `refinery run` made (imported and sampler runs have no checkpoints of their own)."""
    import json

    runs = scan(store, "runs").select("run_id", "created_at", "config").collect().sort("created_at")
    own = [r for r, c in zip(runs["run_id"], runs["config"]) if made_by(json.loads(c)) is None]
    if not own:
        raise ValueError(f"the store {store.uri} has no runs of `refinery run`; start one with `refinery run`")
    return own[-1]


def run_config(store: Store, run_id: str, purpose: str):
    """The stored config of a `refinery run` run as a RunConfig, read as a resume reads it (`stored_base`: a
    run stored before eval.decoding existed is evaluated as it was, sampled); a run made otherwise is refused
    in one line."""
    from flows.config import RunConfig, stored_base
    from storage.runs import stored_config

    cfg = stored_config(store, run_id)
    if cfg is None:
        raise ValueError(f"run {run_id!r} is not in the store {store.uri}")
    other = made_by(cfg)
    if other:
        raise ValueError(f"run {run_id} was made by {other}, not `refinery run`: it has no checkpoints of its "
                         f"own to {purpose}")
    return RunConfig.model_validate(stored_base(cfg)[0])


MAX_DATASET_NAME = 100  # the stage name eval-v<version>-<name>-<8 hex> stays within the store's 128 characters


def dataset_prompts(path: str, name: str | None) -> tuple[str, str, pl.DataFrame, list]:
    """(name, content digest, prompts frame, source rows) of a prompt file; nothing lands here."""
    from pathlib import Path

    from storage.store import check_name
    from tasks.core.ids import digest
    from tasks.ingest import IngestRejected, load_source

    name = name or Path(path).stem
    try:
        check_name("dataset name", name)
    except ValueError as e:
        raise ValueError(f"{e} (pass --dataset-name)") from None
    if len(name) > MAX_DATASET_NAME:
        raise ValueError(f"dataset name {name[:20]!r}... is {len(name)} characters: use at most "
                         f"{MAX_DATASET_NAME} (pass --dataset-name)")
    rows, bad = load_source(path, source_name=name)
    if bad:
        raise IngestRejected(path, bad)
    ids = list(dict.fromkeys(r.prompt_id for r in rows))  # file order, duplicates once
    frame = pl.DataFrame({"prompt_id": [r.prompt_id for r in rows], "text": [r.text for r in rows],
                          "answer": [r.answer for r in rows], "source": [r.source for r in rows],
                          "meta": [r.meta for r in rows]}, schema={"prompt_id": pl.String, "text": pl.String,
                                                                   "answer": pl.String, "source": pl.String,
                                                                   "meta": pl.String})
    frame = frame.unique("prompt_id", keep="first").sort("prompt_id")
    return name, digest("\x1f".join(sorted(ids)))[:8], frame, rows


def refuse_other_file(s: Store, run_ids: list[str], name: str, ids: set[str], hint: str) -> None:
    """One name, one file, per run: raise if any of `run_ids` already has results under split
    `dataset:<name>` for other prompts than `ids` (they would be mixed into one split)."""
    seen = (scan(s, "eval_results")
            .filter(pl.col("run_id").is_in(run_ids) & (pl.col("split") == f"dataset:{name}"))
            .group_by("run_id").agg(pl.col("prompt_id").unique()).collect())
    for run_id, got in seen.iter_rows():
        if set(got) != ids:
            raise ValueError(f"run {run_id} already has results for a different file named {name!r}; {hint}")


@dataclass(frozen=True)
class EvalTarget:
    """What `evaluate` will evaluate, checked: the run, its config, the checkpoint's row (policy_version,
    round, path), the stage and split, the prompts (the held-out split's or the dataset's), and a dataset's
    source rows to land (None for the held-out split)."""

    run_id: str
    config: RunConfig
    checkpoint_row: dict
    stage: str
    split: str
    prompts: pl.DataFrame
    rows: list | None


def evaluated(s: Store, run_id: str, version: int) -> bool:
    """Has the run any `evals` row of this checkpoint?"""
    from storage.query import scan

    rows = scan(s, "evals").filter((pl.col("run_id") == run_id) & (pl.col("policy_version") == version))
    return rows.select(pl.len()).collect().item() > 0


def eval_target(s: Store, run_id: str | None, checkpoint: int | None, dataset: str | None,
                dataset_name: str | None) -> EvalTarget:
    """The evaluate flow's input checked against the store, nothing landed: the run (default the newest
    `refinery run` run), the checkpoint (default its newest), the prompts (the held-out split, which must not
    be empty, or a valid file whose name has no other file's results in the run). Each refusal is a
    one-line ValueError. `refinery eval` calls it before Prefect's server is up, the flow again (a UI run)."""
    from models.checkpoints import checkpoint_gone
    from storage.checkpoints import checkpoint_versions
    from tasks.evaluate import checkpoint_stage, heldout_prompts

    run_id = run_id or latest_run(s)
    config = run_config(s, run_id, "evaluate")
    known = checkpoint_versions(s, run_id)
    if known.height == 0:
        known = pl.DataFrame({"policy_version": [0], "round": [0], "path": [config.model.policy]})
    if checkpoint is None:
        checkpoint = int(known["policy_version"].max())
    row = known.filter(pl.col("policy_version") == checkpoint)
    if row.height == 0:
        raise ValueError(f"run {run_id} has no checkpoint {checkpoint}; it has "
                         f"{', '.join(map(str, known['policy_version'].to_list()))}")
    if checkpoint and checkpoint_gone(s, row["path"][0]) and not evaluated(s, run_id, checkpoint):
        # never evaluated and gone: pruned (a store copied without its weights keeps its landed evaluations)
        raise ValueError(f"run {run_id}'s checkpoint {checkpoint} was pruned (train.keep_checkpoints = 'evaluated' "
                         f"keeps the newest and the evaluated versions) or deleted: {row['path'][0]} is gone")
    if dataset is None:
        heldout = heldout_prompts(s, run_id)
        if heldout.height == 0:
            raise ValueError(f"run {run_id} has no held-out prompts (eval.heldout_fraction was 0, or the run "
                             "predates held-out splits)")
        return EvalTarget(run_id, config, row.row(0, named=True), checkpoint_stage(checkpoint, "heldout"), "heldout",
                          heldout, None)
    name, _, prompts, rows = dataset_prompts(dataset, dataset_name)
    refuse_other_file(s, [run_id], name, set(prompts["prompt_id"]), "pass another --dataset-name")
    split = f"dataset:{name}"
    return EvalTarget(run_id, config, row.row(0, named=True), checkpoint_stage(checkpoint, split, prompts), split,
                      prompts, rows)


@flow(name="evaluate", validate_parameters=True)
def evaluate(run_id: str | None = None, checkpoint: int | None = None, store: str | None = None,
             dataset: str | None = None, dataset_name: str | None = None) -> dict:
    """Evaluate checkpoint `checkpoint` (a policy_version; default the newest) of run `run_id` (default the
    newest run `refinery run` made) on the run's held-out split, or on the prompt file `dataset` (split `dataset:<name>`)."""
    from tasks.evaluate import evaluate_task
    from tasks.stage import RoundContext

    s = Store(store or default_root())
    target = eval_target(s, run_id, checkpoint, dataset, dataset_name)
    run_id, config, r, split = target.run_id, target.config, target.checkpoint_row, target.split
    checkpoint = r["policy_version"]
    if target.rows is not None:
        from tasks.ingest import commit_prompts

        commit_prompts(s, target.rows)  # only now: a refused file lands nothing
    ctx = RoundContext(store=s.uri, run_id=run_id, round=r["round"], policy_version=checkpoint,
                       base=config.model.policy, rounds=config.rounds, model=config.model, scale=config.scale)
    # the stage (tasks/evaluate.py) skips a landed eval-v<N>, and reports held-out numbers that landed already
    out = evaluate_task(ctx, [(checkpoint, r["path"])], config.eval, config.rollout, config.reward, split=split,
                        prompts=None if split == "heldout" else target.prompts)
    landed = scan(s, "evals").filter((pl.col("run_id") == run_id) & (pl.col("policy_version") == checkpoint))
    return {"run_id": run_id, "policy_version": checkpoint, "stage": out, "split": split,
            "evals": landed.sort("round", "split").collect().to_dicts()}
