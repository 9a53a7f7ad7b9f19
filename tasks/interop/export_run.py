"""Export a run's evolved curriculum for another trainer (`refinery export RUN_ID --format trl|verl|sft OUT`).

Round R's curriculum is the pool the run trained from in round R (default: its last round), one row per
trainable prompt (pool status `active` or `reserve`; held-out and retired prompts are never exported, so an
external trainer cannot train on the run's held-out split):
- `prompt`: the chat messages Refinery itself sends (tasks/core/fewshot.py `ask`: the question, a newline, the
  run's `rollout.instruction`; an imported run has no instruction, its prompt is the text as imported). Few-shot
  demonstrations are a rollout-time augmentation and are not part of the exported prompt;
- `answer`, `prompt_id`, `root_id`, `parent_id`, `transform` (`original` or the refinement that made the
  variant), `source`, `status`;
- `eps`, `bucket`, `mean_reward`, `scored_round`: the prompt's newest EPS score at or before round R (null if
  it was never rolled out);
- `selected`, `cluster`, `weight`: whether round R trained on it (among the round's own rollouts: not a later
  rescore's, not DAPO's discarded groups; for a round drawn but not yet collected, such as a sampler's next
  batch, in its `selections`), and, for a drawn prompt, its k-means cluster and the selection's weight (kmeans:
  the cluster's softmax weight, the batch share the selector gave that cluster). Training on the `selected`
  rows reproduces the round's batch.
The default round is the last one whose batch was drawn or collected.
Formats (docs/interop.md documents the mapping):
- `trl`: those columns; TRL's GRPOTrainer reads `prompt` (conversational) and passes the other columns to the
  reward functions as keyword arguments (`answer` for a verifier);
- `verl`: the same plus verl's RL dataset columns: `data_source` (the source), `ability` (`refinery`),
  `reward_model` {style: rule, ground_truth: answer} and `extra_info` {split: train, index, prompt_id};
- `sft`: the run's correct shaped traces of rounds <= R (the MCMC-reshaped off-policy traces that train as
  SFT rows), one row per trace: `messages` (the user turn, then the trace as the assistant turn) and
  `prompt_id`, `root_id`, `answer`, `round`, `trace_id`, `origin`, `start_logprob`, `end_logprob`.
The output is one Parquet file (Hugging Face `datasets.load_dataset("parquet", data_files=OUT)` reads it),
written to a temporary name and renamed, so a failed export leaves nothing. An existing OUT is refused unless
`overwrite`; an OUT inside the store is always refused (the store's folders hold landed data).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from storage.query import scan
from storage.rounds import prompts, this_round
from storage.runs import stored_config
from storage.store import Store
from tasks.core.fewshot import ask

FORMATS = ("trl", "verl", "sft")
MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


@dataclass
class ExportSummary:
    run_id: str
    format: str
    round: int
    rows: int
    selected: int
    out: str

    def __str__(self) -> str:
        what = "shaped traces" if self.format == "sft" else f"prompts ({self.selected} selected in round {self.round})"
        return f"export {self.format}: run {self.run_id} round {self.round}, {self.rows} {what} -> {self.out}"


def instruction_of(config: dict) -> str:
    """The run's rollout instruction (empty for an imported run, whose prompts are the text as imported)."""
    if "imported" in config:
        return ""
    return str(config.get("rollout", {}).get("instruction", ""))


def curriculum_rows(store: Store, run_id: str, round: int, instruction: str) -> pl.DataFrame:
    """Round `round`'s trainable pool with its text, lineage, newest EPS score and selection."""
    pool = (this_round(store, "pool", run_id, round).filter(pl.col("status").is_in(["active", "reserve"]))
            .select("prompt_id", "status").unique("prompt_id"))
    text = prompts(store, "text", "answer", "source", "root_id", "parent_id", "transform")
    scores = (scan(store, "prompt_scores").filter((pl.col("run_id") == run_id) & (pl.col("round") <= round))
              .sort("round", "policy_version")
              .group_by("prompt_id").agg(pl.col("eps").last(), pl.col("bucket").last(), pl.col("mean_reward").last(),
                                         pl.col("round").last().alias("scored_round")))
    drawn = this_round(store, "selections", run_id, round).select("prompt_id", "cluster", "weight").collect()
    if store.landed(run_id, round, "collect") or store.landed(run_id, round, "import"):
        # what the round trained on: its own rollouts (not a later rescore's, not DAPO's discarded groups)
        own = this_round(store, "rollouts", run_id, round)
        trained = (own.filter(pl.col("policy_version") == own.select(pl.col("policy_version").min()).collect().item())
                   .select("prompt_id").unique().collect())
    else:  # drawn, not yet collected (the next batch of a sampler or an interrupted run)
        trained = drawn.select("prompt_id")
    chosen = (trained.unique("prompt_id").join(drawn.unique("prompt_id"), on="prompt_id", how="left")
              .with_columns(pl.lit(True).alias("selected")))
    rows = (pool.join(text, on="prompt_id", how="left").join(scores, on="prompt_id", how="left").collect()
            .join(chosen, on="prompt_id", how="left")
            .with_columns(pl.col("selected").fill_null(False)).sort("prompt_id"))
    missing = rows.filter(pl.col("text").is_null())
    if missing.height:
        raise ValueError(f"run {run_id} round {round}: pool prompt {missing['prompt_id'][0]} is not in the "
                         "prompts table (a damaged store)")
    messages = [[ask(t, instruction)] for t in rows["text"].to_list()]
    return rows.with_columns(pl.Series("prompt", messages, dtype=pl.List(pl.Struct({"role": pl.String,
                                                                                  "content": pl.String}))))


PROMPT_COLUMNS = ["prompt", "answer", "prompt_id", "root_id", "parent_id", "transform", "source", "status", "eps",
                  "bucket", "mean_reward", "scored_round", "selected", "cluster", "weight"]


def verl_columns(rows: pl.DataFrame) -> pl.DataFrame:
    """verl's RL dataset columns (data_source, prompt, ability, reward_model, extra_info) added to ours."""
    return rows.with_columns(
        pl.col("source").alias("data_source"),
        pl.lit("refinery").alias("ability"),
        pl.struct(pl.lit("rule").alias("style"), pl.col("answer").alias("ground_truth")).alias("reward_model"),
        pl.struct(pl.lit("train").alias("split"), pl.int_range(pl.len(), dtype=pl.Int64).alias("index"),
                  pl.col("prompt_id")).alias("extra_info"))


def sft_rows(store: Store, run_id: str, round: int, instruction: str) -> pl.DataFrame:
    traces = (scan(store, "shaped_traces").filter((pl.col("run_id") == run_id) & (pl.col("round") <= round)
                                                  & pl.col("correct"))
              .select("prompt_id", "round", "trace_id", "origin", "text", "start_logprob", "end_logprob")
              .unique("trace_id", keep="first").join(prompts(store, "text", "answer", "root_id")
                                                     .rename({"text": "question"}), on="prompt_id", how="left")
              .sort("round", "prompt_id", "trace_id").collect())
    messages = [[ask(q, instruction), {"role": "assistant", "content": t}]
                for q, t in zip(traces["question"].to_list(), traces["text"].to_list())]
    return (traces.with_columns(pl.Series("messages", messages, dtype=pl.List(pl.Struct({"role": pl.String,
                                                                                       "content": pl.String}))))
            .select("messages", "prompt_id", "root_id", "answer", "round", "trace_id", "origin", "start_logprob",
                    "end_logprob"))


def in_store(store: Store, path: Path) -> Path | None:
    """`path` relative to the root of the local store `store` (`.` for the root itself) when it lies inside it,
    links resolved; else None (a remote store holds no local path)."""
    if not store.local:
        return None
    root, path = Path(store.root).resolve(), path.expanduser().resolve()
    return path.relative_to(root) if path == root or root in path.parents else None


def check_out(store: Store, out: str, overwrite: bool) -> Path:
    """The output path, refused when it would land inside the store or replace a file unasked."""
    if "://" in out:
        raise ValueError(f"OUT {out!r}: export writes a local file (copy it to object storage afterwards)")
    path = Path(out).expanduser().resolve()
    if in_store(store, path) is not None:
        raise ValueError(f"OUT {out!r} is inside the store {store.uri}; the store's folders hold landed data, "
                         "export elsewhere")
    if path.is_dir():
        raise ValueError(f"OUT {out!r} is a folder; name the .parquet file to write")
    if path.exists() and not overwrite:
        raise ValueError(f"OUT {out!r} exists; pass --overwrite to replace it")
    if not path.parent.is_dir():
        raise ValueError(f"OUT {out!r}: its folder {path.parent} does not exist")
    return path


def export_run(store: Store, run_id: str, fmt: str, out: str, round: int | None = None,
               overwrite: bool = False) -> ExportSummary:
    """Write round `round` (default: the run's last) of `run_id` as `fmt` to the Parquet file `out`."""
    if fmt not in FORMATS:
        raise ValueError(f"export format {fmt!r}: use one of {', '.join(FORMATS)}")
    config = stored_config(store, run_id)
    if config is None:
        raise ValueError(f"no run {run_id!r} in the store {store.uri}")
    path = check_out(store, out, overwrite)
    pooled = (scan(store, "pool").filter(pl.col("run_id") == run_id).select(pl.col("round").unique())
              .collect()["round"].sort().to_list())
    # a round counts once its batch was drawn or collected (an interrupted run's last pool may have neither)
    rounds = [r for r in pooled if any(store.landed(run_id, r, s) for s in ("select", "collect", "import"))]
    if not rounds:
        raise ValueError(f"run {run_id} has no round with a drawn or collected batch yet")
    if round is None:
        round = rounds[-1]
    elif round not in rounds:
        raise ValueError(f"run {run_id} has no round {round} with a drawn or collected batch (its rounds: "
                         f"{', '.join(map(str, rounds))})")
    instruction = instruction_of(config)
    if fmt == "sft":
        frame = sft_rows(store, run_id, round, instruction)
        if frame.height == 0:
            raise ValueError(f"run {run_id} has no correct shaped trace in rounds 0-{round} (shape.enabled off, "
                             "or no chain ended correct); nothing to export as SFT")
        selected = 0
    else:
        rows = curriculum_rows(store, run_id, round, instruction)
        if rows.height == 0:
            raise ValueError(f"run {run_id} round {round} has no trainable prompt (active or reserve) to export")
        frame = rows.select(PROMPT_COLUMNS)
        if fmt == "verl":
            frame = verl_columns(frame)
        selected = int(rows["selected"].sum())
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        table = frame.to_arrow()
        meta = {b"refinery": json.dumps({"run_id": run_id, "round": round, "format": fmt}).encode()}
        pq.write_table(table.replace_schema_metadata({**(table.schema.metadata or {}), **meta}), tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return ExportSummary(run_id, fmt, round, frame.height, selected, str(path))
