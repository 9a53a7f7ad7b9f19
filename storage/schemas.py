"""The experience store's tables: explicit pyarrow schemas (types and nullability). It runs over 300 lines because it is
the one declaration of every table, each column commented where it is: split, a reader would look in two places.

Column names are a contract with users' SQL (README.md, "The experience store"): columns may be added, never renamed.
JSON-valued columns (`config`, `params`, `meta`, `teacher_call`) hold JSON strings.
`run_id` is a string, `round` a 0-based int, `policy_version` an int per run (0 = starting model).
"""

from __future__ import annotations

import pyarrow as pa

TS = pa.timestamp("us", tz="UTC")


def _f(name: str, typ: pa.DataType, nullable: bool = False) -> pa.Field:
    return pa.field(name, typ, nullable=nullable)


_ROLLOUT_FIELDS = [  # `rollouts`, and `discarded_rollouts` around its two extra columns
    _f("run_id", pa.string()),
    _f("round", pa.int32()),
    _f("policy_version", pa.int32()),
    _f("prompt_id", pa.string()),
    _f("sample_idx", pa.int32()),
    _f("prompt_text", pa.string()),
    _f("completion", pa.string()),
    _f("reward", pa.float64()),
    _f("correct", pa.bool_()),
    _f("n_tokens", pa.int32()),
    _f("mean_logprob", pa.float64(), True),
    _f("finish_reason", pa.string()),
    _f("augmentation", pa.string(), True),
    _f("verify_timeout", pa.bool_(), True),  # the verifier overran its timeout (scored 0); null: older rows
    # the completion's token ids as sampled, its end token included when it stopped, and each one's log-prob at
    # the sampling temperature as the sampler reported it: what training runs and its old log-probs
    # (tasks/train.py). Null where the backend did not report them all (a text-only endpoint, an end token
    # without its id), in imported rows and in older rows: training then encodes `completion` again
    _f("token_ids", pa.list_(pa.int32()), True),
    _f("token_logprobs", pa.list_(pa.float32()), True),
]


TABLES: dict[str, pa.Schema] = {
    "runs": pa.schema([
        _f("run_id", pa.string()),
        _f("created_at", TS),
        _f("status", pa.string()),
        _f("config", pa.string()),
        _f("host", pa.string(), True),  # where the process that wrote the row ran
        _f("pid", pa.int64(), True),
        _f("reason", pa.string(), True),  # why a run is marked failed
        # the code that wrote the row (storage/provenance.py): its git commit, and whether the code had
        # uncommitted changes; null in rows written before they were recorded
        _f("commit", pa.string(), True),
        _f("dirty", pa.bool_(), True),
    ]),
    "prompts": pa.schema([
        _f("prompt_id", pa.string()),
        _f("text", pa.string()),
        _f("answer", pa.string()),
        _f("solution", pa.string(), True),
        _f("source", pa.string()),
        _f("params", pa.string(), True),
        _f("parent_id", pa.string(), True),
        _f("root_id", pa.string()),
        _f("transform", pa.string()),
        _f("run_id", pa.string(), True),  # null for ingested prompts
        _f("round", pa.int32(), True),  # null for ingested prompts
        _f("created_at", TS),
        _f("meta", pa.string(), True),
        _f("external_id", pa.string(), True),  # the `id` a source file gave the row, if any
    ]),
    "pool": pa.schema([
        _f("run_id", pa.string()),
        _f("round", pa.int32()),
        _f("prompt_id", pa.string()),
        _f("status", pa.string()),  # active | reserve | retired | heldout
        _f("level", pa.string(), True),
        # round 0 under eval.heldout_split 'stratified': the prompt's pool source entry (tasks/core/heldout.py
        # `stratum_name`); null in later rounds, under 'flat' and in older rows
        _f("stratum", pa.string(), True),
    ]),
    "rollouts": pa.schema(_ROLLOUT_FIELDS),
    # DAPO dynamic sampling's and screening's discards (tasks/core/dapo.py, tasks/core/screening.py): groups
    # generated in the round but not kept. The columns of `rollouts` plus the generation batch and why the group was dropped, so the
    # spend is one query (`SELECT round, count(*), sum(n_tokens) FROM discarded_rollouts WHERE run_id = ...`).
    # Nothing reads them back as the round's rollouts (no GRPO row, no pool move); what they show about a prompt
    # is read: by score (a screened-out prompt's bucket), the pass-rate posterior, the governor and shaping's
    # choice of unsolved prompts.
    "discarded_rollouts": pa.schema([
        *_ROLLOUT_FIELDS[:4],
        _f("gen_batch", pa.int32()),  # 0-based generation batch of the round (0: the select stage's draw)
        _f("reason", pa.string()),  # zero_variance | surplus (varied, but the batch was already full) | screened_out
        *_ROLLOUT_FIELDS[4:],
    ]),
    "prompt_scores": pa.schema([
        _f("run_id", pa.string()),
        _f("round", pa.int32()),
        _f("policy_version", pa.int32()),
        _f("prompt_id", pa.string()),
        _f("n", pa.int32()),
        _f("mean_reward", pa.float64()),
        _f("std_reward", pa.float64()),
        _f("eps", pa.float64()),
        _f("bucket", pa.string()),
    ]),
    "refinements": pa.schema([
        _f("run_id", pa.string()),
        _f("round", pa.int32()),
        _f("parent_id", pa.string()),
        _f("child_id", pa.string(), True),  # null when the strategy could not make a child at all
        _f("strategy", pa.string()),
        _f("accepted", pa.bool_()),
        _f("reason", pa.string(), True),
        _f("teacher_call", pa.string(), True),
    ]),
    "selections": pa.schema([
        _f("run_id", pa.string()),
        _f("round", pa.int32()),
        _f("prompt_id", pa.string()),
        _f("selector", pa.string()),
        _f("cluster", pa.int32(), True),
        _f("weight", pa.float64(), True),
        _f("reason", pa.string(), True),
    ]),
    # What the pass-rate model (tasks/core/passrate.py) predicted for each prompt a selector scored before the
    # round generated anything; what happened is in prompt_scores (and rollouts) at the same (run, round, prompt).
    "predictions": pa.schema([
        _f("run_id", pa.string()),
        _f("round", pa.int32()),
        _f("prompt_id", pa.string()),
        _f("selector", pa.string()),
        _f("bin", pa.string()),
        _f("alpha", pa.float64()),
        _f("beta", pa.float64()),
        _f("predicted_pass_rate", pa.float64()),  # the posterior mean
        _f("predicted_informative", pa.float64()),  # P(a group of G is mixed) under the posterior
        _f("draw", pa.float64(), True),  # the Thompson draw of the pass rate, where one was made
        _f("picked", pa.bool_()),
    ]),
    # The budget governor's decision per component and round (tasks/govern.py, tasks/core/governor.py): the newest
    # measured round's training rows per 1k generated tokens against plain rollouts', and the throttle it set.
    "governor": pa.schema([
        _f("run_id", pa.string()),
        _f("round", pa.int32()),  # the round the decision applies to (made from rounds before it)
        _f("component", pa.string()),
        _f("field", pa.string()),  # the config field held at its minimum while throttled
        _f("measured_round", pa.int32(), True),
        _f("tokens", pa.int64(), True),
        _f("rows", pa.float64(), True),
        _f("yield_per_1k", pa.float64(), True),
        _f("baseline_per_1k", pa.float64(), True),
        _f("below_rounds", pa.int32()),
        _f("throttled", pa.bool_()),
        _f("decision", pa.string()),  # start | keep | throttle | restore | idle
    ]),
    "shaped_traces": pa.schema([
        _f("run_id", pa.string()),
        _f("round", pa.int32()),
        _f("prompt_id", pa.string()),
        _f("trace_id", pa.string()),
        _f("origin", pa.string()),  # 'reference' (the prompt's solution) | 'teacher'
        _f("text", pa.string()),  # the shaped trace
        _f("start_logprob", pa.float64(), True),  # mean per-token log-prob under the policy; null: not in C
        _f("end_logprob", pa.float64(), True),
        _f("steps", pa.int32()),
        _f("accept_rate", pa.float64(), True),
        _f("correct", pa.bool_()),
        _f("tokens_changed", pa.int32()),
        _f("variant", pa.string(), True),  # 'mh' | 'greedy'
        _f("start_text", pa.string(), True),  # the off-policy trace the chain started from
    ]),
    "train_steps": pa.schema([
        _f("run_id", pa.string()),
        _f("round", pa.int32()),
        _f("step", pa.int32()),
        _f("policy_version", pa.int32()),
        _f("loss", pa.float64()),
        _f("pg_loss", pa.float64()),
        _f("sft_loss", pa.float64(), True),
        _f("kl", pa.float64(), True),
        _f("entropy", pa.float64(), True),
        _f("grad_norm", pa.float64(), True),
        _f("clip_frac", pa.float64(), True),
        _f("n_tokens", pa.int64()),
        _f("seconds", pa.float64()),
        _f("replay_share", pa.float64(), True),  # replayed rows / the step's rows (tasks/core/replay.py); null: off
    ]),
    "evals": pa.schema([
        _f("run_id", pa.string()),
        _f("round", pa.int32()),
        _f("policy_version", pa.int32()),
        _f("split", pa.string()),
        _f("n_prompts", pa.int32()),
        _f("k", pa.int32()),
        _f("pass_at_1", pa.float64()),
        _f("pass_at_k", pa.float64()),
        # the generated-token milestone this evaluation is at (tasks/evaluate.py: a multiple of
        # eval.milestone_tokens, 0 for the base model) and the run's generated tokens before the checkpoint
        # (evaluation excluded); null: evaluated every round, `refinery eval`, or older rows
        _f("milestone", pa.int64(), True),
        _f("generated_tokens", pa.int64(), True),
        # a greedy held-out evaluation's digest of what it computed (tasks/evaluate.py `plan_key`), and the run
        # whose rows it copied instead of generating them (storage/evals.py); null otherwise and in older rows
        _f("plan_key", pa.string(), True),
        _f("reused_from", pa.string(), True),
    ]),
    "eval_results": pa.schema([  # one row per (evaluation, prompt): what bootstrap intervals resample
        _f("run_id", pa.string()),
        _f("round", pa.int32()),
        _f("policy_version", pa.int32()),
        _f("split", pa.string()),
        _f("prompt_id", pa.string()),
        _f("n_samples", pa.int32()),
        _f("n_correct", pa.int32()),
        _f("n_tokens", pa.int64()),
    ]),
    "generated_tokens": pa.schema([  # what each stage generated, by purpose (models/meter.py)
        _f("run_id", pa.string()),
        _f("round", pa.int32()),
        _f("stage", pa.string()),
        _f("purpose", pa.string()),
        _f("calls", pa.int32()),
        _f("completions", pa.int64()),
        _f("tokens", pa.int64()),
    ]),
    "checkpoints": pa.schema([
        _f("run_id", pa.string()),
        _f("policy_version", pa.int32()),
        _f("parent_version", pa.int32(), True),
        _f("round", pa.int32()),
        _f("path", pa.string()),
        _f("created_at", TS),
    ]),
    # Teacher answers by payload hash, landed as each call returns, so a rerun (or a crash mid-refine)
    # never pays for the same call twice.
    "teacher_calls": pa.schema([
        _f("key", pa.string()),
        _f("teacher", pa.string()),
        _f("response", pa.string()),
        _f("created_at", TS),
        _f("n_tokens", pa.int64(), True),  # tokens the teacher generated; null: an endpoint's, or written before
    ]),
    # Selection's cache and state (docs/algorithms.md §4): one vector per (prompt, embedder), and each round's
    # k-means centroids, from which the next round warm-starts.
    "embeddings": pa.schema([
        _f("prompt_id", pa.string()),
        _f("embedder", pa.string()),
        _f("vector", pa.list_(pa.float32())),
    ]),
    "centroids": pa.schema([
        _f("run_id", pa.string()),
        _f("round", pa.int32()),
        _f("cluster", pa.int32()),
        _f("embedder", pa.string()),
        _f("size", pa.int32()),
        _f("utility", pa.float64()),
        _f("weight", pa.float64()),
        _f("vector", pa.list_(pa.float32())),
    ]),
}

_DUCKDB_TYPES = {
    pa.string(): "VARCHAR",
    pa.int32(): "INTEGER",
    pa.int64(): "BIGINT",
    pa.float64(): "DOUBLE",
    pa.bool_(): "BOOLEAN",
    TS: "TIMESTAMP WITH TIME ZONE",
    pa.list_(pa.float32()): "FLOAT[]",
    pa.list_(pa.int32()): "INTEGER[]",
}


class NotFound(KeyError):
    """A name the user gave (a table, a prompt id) that the store does not have: bad input the user can fix,
    so the CLI prints its message alone (flows/cli/errors.py). A plain KeyError is a programming slip and is
    reported as a bug. str() is the message itself, without KeyError's repr quotes."""

    user_facing = True

    def __str__(self) -> str:
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


def schema(table: str) -> pa.Schema:
    try:
        return TABLES[table]
    except KeyError:
        raise NotFound(f"unknown table {table!r}; the store's tables are: {', '.join(TABLES)}") from None


def conform(table: str, data: pa.Table) -> pa.Table:
    """Cast `data` to the table's schema, in its column order, naming any missing or mistyped column."""
    target = schema(table)
    missing = [f.name for f in target if f.name not in data.column_names and not f.nullable]
    if missing:
        raise ValueError(f"table {table!r}: required column(s) missing: {', '.join(map(repr, missing))}")
    cols = []
    for f in target:
        if f.name in data.column_names:
            col = data.column(f.name)
            if not f.nullable and col.null_count:
                raise ValueError(f"table {table!r}: column {f.name!r} has {col.null_count} null value(s)")
            try:
                cols.append(col.cast(f.type))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise ValueError(f"table {table!r}: column {f.name!r} cannot be {f.type}: {e}") from None
        else:
            cols.append(pa.nulls(len(data), f.type))
    return pa.Table.from_arrays(cols, schema=target)


def empty_select_sql(table: str) -> str:
    """A zero-row SELECT with the table's column types, for views over tables that have no data yet."""
    cols = ", ".join(f'CAST(NULL AS {_DUCKDB_TYPES[f.type]}) AS "{f.name}"' for f in schema(table))
    return f"SELECT {cols} WHERE false"
