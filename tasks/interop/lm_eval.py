"""A run's held-out split (and its `refinery eval --dataset` sets) as local lm-evaluation-harness tasks.

`refinery export RUN --heldout --format lm-eval OUT_DIR` writes, per evaluated set, a task config
`<task>.yaml` and its data `data/<set>.jsonl` (the `test` split), so that
`lm_eval --model hf --model_args pretrained=CHECKPOINT --include_path OUT_DIR --tasks <task> --apply_chat_template`
scores any checkpoint on the prompts Refinery evaluates. Sets:
- `heldout`: the run's held-out split, fixed at round 0 (pool status `heldout`, tasks/core/heldout.py: a hash
  of (eval seed, root_id) picks the roots), as tasks/evaluate.py reads it; task `refinery_<run>_heldout`;
- `dataset_<name>`: each prompt file `refinery eval --dataset` evaluated for the run (the prompts of its
  `eval_results` rows under split `dataset:<name>`); task `refinery_<run>_dataset_<name>`.
Each JSONL row: `prompt_id`, `question` (the text), `prompt` (the user turn our evaluation sends, tasks/core/
fewshot.py `ask`: the question, a newline, the run's `rollout.instruction`), `answer`, `source`.

The task (keys of lm-eval 0.4's task YAML, docs/interop.md): `doc_to_text: prompt` and `doc_to_target: answer`
(column names), `output_type: generate_until`, greedy decoding (`do_sample: false`, `temperature: 0`) up to the
run's `rollout.max_new_tokens`, stopping only at end of sequence (`until: []`: lm-eval adds the EOS token; its
default, a blank line, would cut a reasoning trace). Our evaluation renders the user turn with the model's chat
template: pass `--apply_chat_template` to do the same. Scoring is a `regex` filter then `exact_match`:
- the filter takes the LAST `\\boxed{...}` (two levels of nested braces) or `<answer>...</answer>` in the
  completion, i.e. Refinery's strict extraction (tasks/core/answers.py); a completion with neither scores 0
  (the non-strict fallbacks, "answer is X" and the last number, have no regex equivalent: a final-match regex
  cannot prefer a box over a later number). A final box cut by the length limit makes Refinery find no answer,
  while the regex may still take an earlier closed box;
- `exact_match` with `ignore_case` and `regexes_to_ignore` stripping leading and trailing whitespace, `$` and
  `.` on both sides: the string half of our `exact_match` normalisation. What does not match as Refinery
  would: numbers by value ("1,000" vs "1000", "5.0" vs "5"), the Unicode minus signs, `\\text{...}`
  unwrapping and inner whitespace runs, math-verify equivalence (the `math` verifier: "\\frac{1}{2}" vs "0.5")
  and reasoning-gym's own scoring (the `rg` verifier, which may give partial credit). So on the same completions
  the harness's score is at most Refinery's greedy pass@1 (but for the cut-box case), equal when answers are
  boxed literals written as the reference writes them.
"""

from __future__ import annotations

import re

import polars as pl

from storage.query import scan
from storage.rounds import prompts, this_round
from storage.store import Store
from tasks.core.fewshot import ask

# the last final box (two nesting levels) or answer tag; lm-eval's regex filter keeps the first non-empty group
FINAL_ANSWER = r"\\boxed\s*\{((?:[^{}]|\{(?:[^{}]|\{[^{}]*\})*\})*)\}|<answer>([\s\S]*?)</answer>"
IGNORE = [r"^[\s$.]+", r"[\s$.]+$"]  # our exact_match strips " $." at both ends


def task_name(run_id: str, set_name: str) -> str:
    """An lm-eval task name (letters, digits, underscores) for a run's set."""
    return re.sub(r"[^A-Za-z0-9_]", "_", f"refinery_{run_id}_{set_name}")


def eval_sets(store: Store, run_id: str, instruction: str) -> dict[str, pl.DataFrame]:
    """Set name -> its docs (prompt_id, question, prompt, answer, source): the held-out split, then each
    `eval --dataset` set the run has results for. Empty sets are left out."""
    text = prompts(store, "text", "answer", "source")
    heldout = (this_round(store, "pool", run_id, 0).filter(pl.col("status") == "heldout").select("prompt_id")
               .unique().join(text, on="prompt_id").sort("prompt_id").collect())
    sets = {"heldout": heldout}
    datasets = (scan(store, "eval_results").filter((pl.col("run_id") == run_id)
                                                   & pl.col("split").str.starts_with("dataset:"))
                .select("split", "prompt_id").unique().join(text, on="prompt_id").sort("split", "prompt_id").collect())
    for (split,), rows in datasets.group_by("split", maintain_order=True):
        sets["dataset_" + split.removeprefix("dataset:")] = rows.drop("split")
    return {name: docs.select(
        "prompt_id", pl.col("text").alias("question"),
        pl.col("text").map_elements(lambda t: ask(t, instruction)["content"], return_dtype=pl.String).alias("prompt"),
        "answer", "source") for name, docs in sets.items() if docs.height}


def task_config(task: str, data_file: str, max_new_tokens: int, run_id: str) -> dict:
    """The lm-eval task YAML (as a dict) for one set whose JSONL lies at the absolute path `data_file`."""
    return {
        "task": task,
        "tag": ["refinery"],
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": data_file}},
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": "prompt",
        "doc_to_target": "answer",
        "generation_kwargs": {"until": [], "do_sample": False, "temperature": 0.0, "max_gen_toks": max_new_tokens},
        "filter_list": [{"name": "final_answer", "filter": [
            {"function": "regex", "regex_pattern": FINAL_ANSWER, "group_select": -1, "fallback": "[no answer]"},
            {"function": "take_first"}]}],
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                         "ignore_case": True, "regexes_to_ignore": IGNORE}],
        "metadata": {"version": 1.0, "refinery_run": run_id},
    }
