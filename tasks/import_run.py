"""Import another trainer's rollout dump as a run of the store (`refinery import FORMAT PATH --run-id ID`).

The readers (tasks/core/dumps.py) turn verl, TRL, prime-rl or plain files into `DumpRow`s; this module lands
them the way Refinery's own rounds land, so `refinery sql`, `lineage` and `report` work on the imported run:
- prompts are content-addressed as on ingest (`prompt_id(text, answer, source)`, source `import:<format>`;
  the text is the prompt as the trainer showed it, chat template included when the dump has it rendered);
- steps map to rounds in order (the k-th distinct step is round k; the step itself is kept in each row's
  `augmentation`), and the policy version of round k is k (the trainer updated once per step);
- groups are rebuilt per (step, prompt), with `sample_idx` in file order (the trainer's group id, where it
  writes one, is kept in `augmentation`; two groups of one prompt in one step become one group, as EPS
  scores a prompt once per round);
- `correct` is reward >= `correct_at` (1.0 by default: the dump's reward is taken as the verifier's score);
  `n_tokens` counts the completion with the named tokenizer (the embedded policy's by default) unless the
  dump records its own count;
- each round gets `pool` rows (its prompts, active), `rollouts`, and EPS `prompt_scores` and buckets
  (tasks/core/eps.py, the run's utility settings), landed as one stage `import` per round; the run gets
  `runs` rows (`running`, then `completed`) whose config records the format, the source path and the
  settings. A rerun of the same import skips the rounds that landed; importing a different dump under a
  run id that exists is refused.
Bad rows are named as on ingest (file, line, problem); by default any bad row rejects the whole dump and
nothing lands, `skip_invalid` lands the good rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import polars as pl

from storage.runs import mark, stored_config
from storage.store import Store
from tasks.core.dumps import read_dump
from tasks.core.eps import eps_scores
from tasks.core.ids import prompt_id
from tasks.core.sources import SourceRow
from tasks.ingest import IngestRejected, commit_prompts


@dataclass
class ImportSummary:
    run_id: str
    format: str
    rows: int
    rounds: int
    prompts: int
    landed_rounds: int
    skipped_rows: list[str]

    def __str__(self) -> str:
        s = (f"import {self.format}: run {self.run_id}, {self.rows} rollouts over {self.rounds} round(s) of "
             f"{self.prompts} distinct prompts; {self.landed_rounds} round(s) landed now")
        return s + (f", {len(self.skipped_rows)} invalid rows skipped" if self.skipped_rows else "")


def _count_tokens(tokenizer: str):
    from transformers import AutoTokenizer

    from models.registry import resolve

    tok = AutoTokenizer.from_pretrained(resolve(tokenizer))
    return lambda texts: [len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]


def import_dump(store: Store, fmt: str, path: str, run_id: str, correct_at: float = 1.0,
                tokenizer: str = "default", skip_invalid: bool = False, beta: float = 0.5, tau: float = 0.0,
                eps: float = 1e-6, reward_column: str | None = None) -> ImportSummary:
    """Read the dump at `path` in format `fmt` and land it as run `run_id` (module docstring)."""
    rows, bad = read_dump(fmt, path, reward_column)
    if bad and not skip_invalid:
        raise IngestRejected(path, bad)
    if not rows:
        raise ValueError(f"{path}: no rollouts to import")
    config = {"imported": {"format": fmt, "path": str(path), "correct_at": correct_at, "tokenizer": tokenizer,
                           "reward_column": reward_column,
                           "utility": {"beta": beta, "tau": tau, "eps": eps}}}
    previous = stored_config(store, run_id)
    if previous is not None and previous != config:
        raise ValueError(f"run {run_id} already exists in {store.uri} and was not this import; choose a new --run-id")
    source = f"import:{fmt}"
    ids = [prompt_id(r.prompt, r.answer, source) for r in rows]
    commit_prompts(store, [SourceRow(pid, r.prompt, r.answer, source) for pid, r in zip(ids, rows)])
    uncounted = [r.completion for r in rows if r.n_tokens is None]
    counted = iter(_count_tokens(tokenizer)(uncounted) if uncounted else [])
    augmentation = [json.dumps({"import": {"format": fmt, "step": r.step, "file": r.file, "line": r.line,
                                           **({"group": r.group} if r.group is not None else {}),
                                           **({"extra": r.extra} if r.extra else {})}}, sort_keys=True, default=str)
                    for r in rows]
    rollouts = pl.DataFrame({
        "prompt_id": ids, "step": [r.step for r in rows], "prompt_text": [r.prompt for r in rows],
        "completion": [r.completion for r in rows], "reward": [float(r.reward) for r in rows],
        "n_tokens": [r.n_tokens if r.n_tokens is not None else next(counted) for r in rows],
        "augmentation": augmentation,
    }).with_columns(
        run_id=pl.lit(run_id),
        round=(pl.col("step").rank("dense") - 1).cast(pl.Int32),  # the k-th distinct step is round k
    ).with_columns(
        policy_version=pl.col("round"),
        # in file order; keyed on the prompt as EPS is: two groups of one prompt in a step are one
        sample_idx=pl.int_range(pl.len()).over("round", "prompt_id").cast(pl.Int32),
        correct=pl.col("reward") >= correct_at,
        mean_logprob=pl.lit(None, pl.Float64), finish_reason=pl.lit("stop"), verify_timeout=pl.lit(None, pl.Boolean),
        token_ids=pl.lit(None, pl.List(pl.Int32)), token_logprobs=pl.lit(None, pl.List(pl.Float32)),
    ).drop("step")
    rounds = rollouts["round"].unique().sort().to_list()
    mark(store, run_id, "running", config)
    landed = 0
    for rnd in rounds:
        if store.landed(run_id, rnd, "import"):
            continue
        mine = rollouts.filter(pl.col("round") == rnd)
        pool = mine.select("run_id", "round", "prompt_id").unique().sort("prompt_id").with_columns(
            status=pl.lit("active"))
        store.commit("import", {"rollouts": mine.to_arrow(), "prompt_scores": eps_scores(mine, beta, tau, eps).to_arrow(),
                                "pool": pool.to_arrow()}, run_id=run_id, round=rnd)
        landed += 1
    mark(store, run_id, "completed", config, reason=f"imported from {fmt} dump {path}")
    return ImportSummary(run_id, fmt, len(rows), len(rounds), len(set(ids)), landed, [str(b) for b in bad])
