"""Export a run's evolved curriculum for another trainer (`refinery export RUN_ID --format trl|verl|sft OUT`), or
its evaluation sets for lm-evaluation-harness (`refinery export RUN_ID --heldout --format lm-eval OUT_DIR`).

Round R's curriculum is the pool the run trained from in round R (default: its last round), one row per
trainable prompt (pool status `active` or `reserve`; held-out and retired prompts are never exported, so an
external trainer cannot train on the run's held-out split; a run with `select.strata` exports only those strata
and their refined children, the prompts it could draw):
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
- `lm-eval`: the run's held-out split and its `eval --dataset` sets as local harness tasks (YAML + JSONL),
  tasks/interop/lm_eval.py; `--heldout` names the split and goes only with this format (held-out prompts are
  never exported as training data).
Where it writes (tasks/interop/output.py): an OUT ending in `.parquet` is the table (Hugging Face
`datasets.load_dataset("parquet", data_files=OUT)` reads it) with its dataset card `<stem>.md` beside it; any
other OUT is a folder in the dataset-repo layout, `data/train-00000-of-00001.parquet` (lm-eval:
`data/<set>.jsonl` and `<task>.yaml`) and `README.md`. Every export writes a dataset card (tasks/interop/
card.py: features, configs, `--license`, the run's provenance). Everything is staged beside OUT and renamed into
place, so a failed export leaves nothing; an OUT inside the store is always refused, an existing one needs
`overwrite` (and a folder is only replaced when an earlier export wrote it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from storage.query import scan
from storage.rounds import pool_candidates, prompts, this_round
from storage.runs import stored_config
from storage.store import Store
from tasks.core.fewshot import ask
from tasks.interop import lm_eval
from tasks.interop.card import card, provenance
from tasks.interop.output import Target, check_out, in_store, staged

__all__ = ["FORMATS", "ExportSummary", "export_run", "in_store"]
FORMATS = ("trl", "verl", "sft", "lm-eval")
MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


@dataclass
class ExportSummary:
    run_id: str
    format: str
    round: int
    rows: int
    selected: int
    out: str
    sets: tuple[str, ...] = ()  # lm-eval: the task names

    def __str__(self) -> str:
        if self.format == "lm-eval":
            return (f"export lm-eval: run {self.run_id}, {self.rows} prompts in {len(self.sets)} task(s) "
                    f"({', '.join(self.sets)}) -> {self.out}\nscore a checkpoint: lm_eval --model hf --model_args "
                    f"pretrained=CHECKPOINT --include_path {self.out} --tasks {','.join(self.sets)} "
                    "--apply_chat_template")
        what = "shaped traces" if self.format == "sft" else f"prompts ({self.selected} selected in round {self.round})"
        return f"export {self.format}: run {self.run_id} round {self.round}, {self.rows} {what} -> {self.out}"


def instruction_of(config: dict) -> str:
    """The run's rollout instruction (empty for an imported run, whose prompts are the text as imported)."""
    if "imported" in config:
        return ""
    return str(config.get("rollout", {}).get("instruction", ""))


def curriculum_rows(store: Store, run_id: str, round: int, instruction: str, strata: list[str] = ()
                    ) -> pl.DataFrame:
    """Round `round`'s trainable pool (of `strata` only, when the run drew from some) with its text, lineage,
    newest EPS score and selection."""
    pool = pool_candidates(store, run_id, round, True, strata, ("prompt_id", "status")).unique("prompt_id")
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


def export_run(store: Store, run_id: str, fmt: str, out: str, round: int | None = None,
               overwrite: bool = False, heldout: bool = False, license: str = "other") -> ExportSummary:
    """Write round `round` (default: the run's last) of `run_id` as `fmt` to `out`, with its dataset card
    (lm-eval: the run's held-out and dataset sets, which are fixed, so `round` does not apply)."""
    if fmt not in FORMATS:
        raise ValueError(f"export format {fmt!r}: use one of {', '.join(FORMATS)}")
    if heldout and fmt != "lm-eval":
        raise ValueError(f"--heldout with --format {fmt}: held-out prompts are never exported as training "
                         "data; --heldout goes with --format lm-eval")
    if fmt == "lm-eval" and round is not None:
        raise ValueError("--round with --format lm-eval: the held-out split is fixed at round 0; drop --round")
    if not license.strip() or "\n" in license:
        raise ValueError(f"--license {license!r}: a license id on one line (e.g. apache-2.0, cc-by-4.0, other)")
    config = stored_config(store, run_id)
    if config is None:
        raise ValueError(f"no run {run_id!r} in the store {store.uri}")
    target = check_out(store, out, overwrite, folder_only=fmt == "lm-eval")
    info = {"run_id": run_id, "format": fmt, **provenance(store, run_id, config)}
    if fmt == "lm-eval":
        return export_lm_eval(store, run_id, config, target, info, license)
    round = export_round(store, run_id, round)
    instruction = instruction_of(config)
    if fmt == "sft":
        frame = sft_rows(store, run_id, round, instruction)
        if frame.height == 0:
            raise ValueError(f"run {run_id} has no correct shaped trace in rounds 0-{round} (shape.enabled off, "
                             "or no chain ended correct); nothing to export as SFT")
        selected = 0
    else:
        rows = curriculum_rows(store, run_id, round, instruction, config.get("select", {}).get("strata") or [])
        if rows.height == 0:
            raise ValueError(f"run {run_id} round {round} has no trainable prompt (active or reserve) to export")
        frame = rows.select(PROMPT_COLUMNS)
        if fmt == "verl":
            frame = verl_columns(frame)
        selected = int(rows["selected"].sum())
    table = frame.to_arrow()
    meta = {b"refinery": json.dumps({"run_id": run_id, "round": round, "format": fmt}).encode()}
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **meta})
    data = "data/train-00000-of-00001.parquet" if target.folder else target.path.name
    info |= {"round": round, "rows": frame.height, **({} if fmt == "sft" else {"selected": selected})}
    with staged(target) as stage:
        (stage / data).parent.mkdir(exist_ok=True)
        pq.write_table(table, stage / data)
        text = card({"default": ("train", data, table.schema, frame.height)}, info, license, fmt,
                    f"Round {round} of run `{run_id}`, exported by `refinery export --format {fmt}`")
        (stage / target.card.name).write_text(text)
    return ExportSummary(run_id, fmt, round, frame.height, selected, str(target.path))


def export_round(store: Store, run_id: str, round: int | None) -> int:
    """The round to export: `round`, checked, or the run's last round whose batch was drawn or collected."""
    pooled = (scan(store, "pool").filter(pl.col("run_id") == run_id).select(pl.col("round").unique())
              .collect()["round"].sort().to_list())
    # a round counts once its batch was drawn or collected (an interrupted run's last pool may have neither)
    rounds = [r for r in pooled if any(store.landed(run_id, r, s) for s in ("select", "collect", "import"))]
    if not rounds:
        raise ValueError(f"run {run_id} has no round with a drawn or collected batch yet")
    if round is None:
        return rounds[-1]
    if round not in rounds:
        raise ValueError(f"run {run_id} has no round {round} with a drawn or collected batch (its rounds: "
                         f"{', '.join(map(str, rounds))})")
    return round


def export_lm_eval(store: Store, run_id: str, config: dict, target: Target, info: dict,
                   license: str) -> ExportSummary:
    """The run's evaluation sets as lm-eval tasks in the folder `target` (tasks/interop/lm_eval.py)."""
    sets = lm_eval.eval_sets(store, run_id, instruction_of(config))
    if "heldout" not in sets:
        raise ValueError(f"run {run_id} has no held-out prompts (eval.heldout_fraction was 0, or the run "
                         "predates held-out splits); nothing to export for lm-eval")
    max_new = int(config.get("rollout", {}).get("max_new_tokens", 64))
    tables, names = {}, []
    info |= {"round": 0, "rows": sum(d.height for d in sets.values())}
    with staged(target) as stage:
        (stage / "data").mkdir()
        for name, docs in sets.items():
            task, data = lm_eval.task_name(run_id, name), f"data/{name}.jsonl"
            docs.write_ndjson(stage / data)
            spec = lm_eval.task_config(task, str(target.path / data), max_new, run_id)
            (stage / f"{task}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False, allow_unicode=True))
            tables[name] = ("test", data, docs.to_arrow().schema, docs.height)
            names.append(task)
        (stage / "README.md").write_text(card(tables, info, license, "lm-eval", (
            f"The evaluation sets of run `{run_id}` (the held-out split fixed at round 0"
            + (", and the `refinery eval --dataset` sets" if len(sets) > 1 else "")
            + f") as lm-evaluation-harness tasks: {', '.join(f'`{n}`' for n in names)}")))
    return ExportSummary(run_id, "lm-eval", 0, info["rows"], 0, str(target.path), tuple(names))
