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
  `runs` rows (`running`, then `completed`) whose config records the format, the dump's digest, the settings
  and (for information only) the dump's path.
An import is identified by its dump's content (`dump_digest`: its files' relative paths and bytes), not its
path: the same dump under another path or as a copy resumes the run (skipping the rounds that landed, and a
no-op when all did), and a different or edited dump under a run id that exists is refused. A run imported
before digests were recorded is still matched by its path. Two phases, so that a refused import writes nothing:
`prepare_import` reads and validates the dump, loads the tokenizer, counts tokens and digests the files, without
touching the store (nor importing Prefect, which makes its home in the store); `land_import` then takes the run
lock (storage/runs.py) and checks the run id before its first commit. Of two imports under one run id started
together, one is refused at once (RunLocked) or takes the lock after the other and is compared by digest.
Bad rows are named as on ingest (file, line, problem); by default any bad row rejects the whole dump and
nothing lands, `skip_invalid` lands the good rows.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import polars as pl

from storage.runs import mark, run_lock, run_rows, stored_config
from storage.store import Store
from tasks.core.dump_digest import dump_digest
from tasks.core.dumps import DumpRejected, DumpRow, read_dump
from tasks.core.eps import eps_scores
from tasks.core.ids import prompt_id
from tasks.core.sources import SourceRow


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


@dataclass
class PreparedImport:
    """A dump read, validated, token-counted and digested: everything `land_import` needs, nothing landed."""

    fmt: str
    rows: list[DumpRow]
    n_tokens: list[int]
    skipped_rows: list[str]
    config: dict  # the run's config: {"imported": {format, digest, path, settings}}


def _count_tokens(tokenizer: str):
    from transformers import AutoTokenizer

    from models.registry import resolve

    try:
        tok = AutoTokenizer.from_pretrained(resolve(tokenizer))
    except Exception as e:  # noqa: BLE001 (a folder that is no checkpoint, an offline hub id, a broken file)
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise ValueError(f"--tokenizer {tokenizer}: cannot load a tokenizer from it ({first})") from None
    return lambda texts: [len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]


def prepare_import(fmt: str, path: str, correct_at: float = 1.0, tokenizer: str = "default",
                   skip_invalid: bool = False, beta: float = 0.5, tau: float = 0.0, eps: float = 1e-6,
                   reward_column: str | None = None) -> PreparedImport:
    """Everything that can fail before anything lands (module docstring); reads no store, writes nothing."""
    if not math.isfinite(correct_at):
        raise ValueError(f"--correct-at {correct_at}: not a finite number")
    if reward_column is not None and fmt != "trl":
        raise ValueError(f"--reward-column {reward_column}: only a trl dump has reward columns to choose from "
                         f"({fmt} reads its one reward field)")
    rows, bad = read_dump(fmt, path, reward_column)
    if bad and not skip_invalid:
        raise DumpRejected(path, bad)
    if not rows:
        raise ValueError(f"{path}: no rollouts to import")
    uncounted = [r.completion for r in rows if r.n_tokens is None]
    counted = iter(_count_tokens(tokenizer)(uncounted) if uncounted else [])
    n_tokens = [r.n_tokens if r.n_tokens is not None else next(counted) for r in rows]
    config = {"imported": {"format": fmt, "digest": dump_digest(fmt, path), "path": os.path.abspath(path),
                           "correct_at": correct_at, "tokenizer": tokenizer, "reward_column": reward_column,
                           "utility": {"beta": beta, "tau": tau, "eps": eps}}}
    return PreparedImport(fmt, rows, n_tokens, [str(b) for b in bad], config)


def _refusal(store: Store, run_id: str, stored: dict, config: dict) -> str | None:
    """Why run `run_id`, stored with `stored`, is not this import (None: it is, so the import resumes)."""
    new, old = config["imported"], stored.get("imported")
    here = f"run {run_id} already exists in {store.uri}"
    if old is None:
        return f"{here} and was not imported; choose a new --run-id"
    if "digest" not in old:  # imported before dumps were digested: identified by its path then

        def settings(c: dict) -> dict:
            return {k: v for k, v in c.items() if k not in ("digest", "path")}

        if os.path.abspath(old.get("path", "")) != new["path"] or settings(old) != settings(new):
            return f"{here} and was imported from {old.get('path')} or with other settings; choose a new --run-id"
        return None
    if (old["format"], old["digest"]) != (new["format"], new["digest"]):
        return (f"{here} and was imported from a different dump: {old.get('path')} ({old['format']}, sha256 "
                f"{old['digest'][:12]}), this one is {new['path']} ({new['format']}, sha256 {new['digest'][:12]}); "
                "choose a new --run-id")
    differs = [k for k in sorted(set(old) | set(new)) if k != "path" and old.get(k) != new.get(k)]
    return (f"{here}, imported from this dump with other settings (differs in: {', '.join(differs)}); choose a "
            "new --run-id") if differs else None


def _json_safe(value):
    """`value` with every float that is not finite (a TRL reward column no function scored is NaN) as None:
    `augmentation` is JSON, and JSON has no NaN (DuckDB's json functions refuse the `NaN` token)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def land_import(store: Store, prepared: PreparedImport, run_id: str) -> ImportSummary:
    """Land a prepared import as run `run_id`, under the run lock: refused, untouched, if the run id is taken
    by another run or dump; a resume skips the rounds that landed (module docstring)."""
    from tasks.ingest import commit_prompts  # imports Prefect: only once the import is known to land

    fmt, rows, config = prepared.fmt, prepared.rows, prepared.config
    source = f"import:{fmt}"
    ids = [prompt_id(r.prompt, r.answer, source) for r in rows]
    augmentation = [json.dumps(_json_safe({"import": {"format": fmt, "step": r.step, "file": r.file, "line": r.line,
                                                      **({"group": r.group} if r.group is not None else {}),
                                                      **({"extra": r.extra} if r.extra else {})}}),
                               sort_keys=True, default=str, allow_nan=False)
                    for r in rows]
    rollouts = pl.DataFrame({
        "prompt_id": ids, "step": [r.step for r in rows], "prompt_text": [r.prompt for r in rows],
        "completion": [r.completion for r in rows], "reward": [float(r.reward) for r in rows],
        "n_tokens": prepared.n_tokens, "augmentation": augmentation,
    }).with_columns(
        run_id=pl.lit(run_id),
        round=(pl.col("step").rank("dense") - 1).cast(pl.Int32),  # the k-th distinct step is round k
    ).with_columns(
        policy_version=pl.col("round"),
        # in file order; keyed on the prompt as EPS is: two groups of one prompt in a step are one
        sample_idx=pl.int_range(pl.len()).over("round", "prompt_id").cast(pl.Int32),
        correct=pl.col("reward") >= config["imported"]["correct_at"],
        mean_logprob=pl.lit(None, pl.Float64), finish_reason=pl.lit("stop"), verify_timeout=pl.lit(None, pl.Boolean),
        token_ids=pl.lit(None, pl.List(pl.Int32)), token_logprobs=pl.lit(None, pl.List(pl.Float32)),
    ).drop("step")
    rounds = rollouts["round"].unique().sort().to_list()
    utility = config["imported"]["utility"]
    with run_lock(store, run_id):
        stored = stored_config(store, run_id)
        if stored is not None and (why := _refusal(store, run_id, stored, config)) is not None:
            raise ValueError(why)
        todo = [rnd for rnd in rounds if not store.landed(run_id, rnd, "import")]
        summary = ImportSummary(run_id, fmt, len(rows), len(rounds), len(set(ids)), len(todo), prepared.skipped_rows)
        if stored is not None and not todo and run_rows(store, run_id)["status"][-1] == "completed":
            return summary  # the same dump again: nothing to land, nothing to record
        commit_prompts(store, [SourceRow(pid, r.prompt, r.answer, source) for pid, r in zip(ids, rows)])
        mark(store, run_id, "running", config)
        for rnd in todo:
            mine = rollouts.filter(pl.col("round") == rnd)
            pool = mine.select("run_id", "round", "prompt_id").unique().sort("prompt_id").with_columns(
                status=pl.lit("active"))
            scores = eps_scores(mine, utility["beta"], utility["tau"], utility["eps"])
            store.commit("import", {"rollouts": mine.to_arrow(), "prompt_scores": scores.to_arrow(),
                                    "pool": pool.to_arrow()}, run_id=run_id, round=rnd)
        mark(store, run_id, "completed", config, reason=f"imported from {fmt} dump {config['imported']['path']}")
    return summary


def import_dump(store: Store, fmt: str, path: str, run_id: str, correct_at: float = 1.0,
                tokenizer: str = "default", skip_invalid: bool = False, beta: float = 0.5, tau: float = 0.0,
                eps: float = 1e-6, reward_column: str | None = None) -> ImportSummary:
    """Read the dump at `path` in format `fmt` and land it as run `run_id` (module docstring)."""
    return land_import(store, prepare_import(fmt, path, correct_at, tokenizer, skip_invalid, beta, tau, eps,
                                             reward_column), run_id)
