"""Readers of other trainers' rollout dumps: each turns files into `DumpRow`s (one per sampled completion)
and `BadRow`s (file, line, problem), as ingest names bad rows. Field names and layouts follow the trainers'
own writers (cited per reader; the fixtures in tests/test_import.py are written the same way):

- `verl`: `trainer.rollout_data_dir` holds `{step}.jsonl`, one JSON object per sample with `input` (the
  decoded prompt, chat template applied, special tokens stripped), `output`, `gts` (ground truth), `score`
  and `step`, plus the reward function's extra keys (volcengine/verl, verl/trainer/ppo/ray_trainer.py,
  `RayPPOTrainer._dump_generations`). No group id is written: groups are the rows of one step with the same
  `input`.
- `trl`: GRPOTrainer with `log_completions=True` writes `<output_dir>/completions/completions_{step:05d}.parquet`
  with `step`, `prompt`, `completion`, one float column per reward function, any `log_extra` columns and
  `advantage` (huggingface/trl, trl/trainer/grpo_trainer.py, `GRPOTrainer.log`). The reward is the unweighted
  sum of the float columns (NaN counts 0, as TRL's nansum; a row whose rewards are all NaN is a bad row), or
  the one `reward_column` names: pass it when the trainer used `reward_weights` or logged float `log_extra`
  columns, which the sum would otherwise include. Groups are the rows of one step with the same prompt.
- `prime-rl`: `outputs/<run>/rollouts/step_{n}/{train|eval}/{all|effective}/traces.jsonl`, one episode per
  line as verifiers' `Episode.to_record` writes it (PrimeIntellect-ai/prime-rl, src/prime_rl/monitors/file.py
  `FileMonitor.log_episodes`): the prompt is `task.data.prompt`, the completion the sampled nodes' message
  contents of the first trainable trace, the reward the sum of score x weight over that trace's scored
  `rewards` (a reward that did not run is null and left out), an episode without a trace is a bad row; the group
  `group.id`, the answer `task.data.answer`, the step `run.work.step` (else the folder's n), and the
  completion's token count the sum of `calls[].usage.completion_tokens`. Only `train/all` (everything
  generated) is read unless another subset is named in the path.
- `plain`: a .jsonl or .parquet of `prompt`, `completion`, `reward` and optional `step` (default 0), `group`
  and `answer`; a prompt may be a string or chat messages (`[{role, content}, ...]`, joined as
  "role: content" lines).

A reward must be a finite number no larger than `MAX_REWARD` in size: 1e308 is finite, but a group's mean and
variance over it overflow, and EPS and `std_reward` would land NaN. A dump is identified by its content,
not its path: `dump_digest` hashes the files its reader reads (their paths relative to the dump, and their
bytes), so the same dump under another path or as a copy is the same dump, and an edited one is not.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.core.sources import BadRow, read_jsonl

FORMATS = ("verl", "trl", "prime-rl", "plain")
MAX_REWARD = 1e15  # far beyond any verifier's score, far below where a group's sums of squares overflow


class DumpRejected(ValueError):
    """A dump had bad rows and --skip-invalid was not given; nothing was written."""

    def __init__(self, path: str, bad: list[BadRow]):
        self.bad = bad
        super().__init__(f"{path}: rejected, {len(bad)} bad row(s), nothing written:\n" + "\n".join(map(str, bad)))


@dataclass(frozen=True)
class DumpRow:
    step: int
    prompt: str
    completion: str
    reward: float
    answer: str = ""
    group: str | None = None  # the trainer's own group id, where it writes one
    n_tokens: int | None = None  # the completion's token count, where the dump records it
    extra: dict[str, Any] = field(default_factory=dict)  # other reward fields, advantages: kept in augmentation
    file: str = ""
    line: int = 0


def _files(path: str, pattern: str) -> list[Path]:
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise ValueError(f"{path}: no such file or folder")
    found = sorted(f for f in p.rglob(pattern) if f.is_file())
    if not found:
        raise ValueError(f"{path}: no {pattern} files in this folder")
    return found


def _name(f: Path, path: str) -> str:
    """A dump file's name as rows record it: relative to the folder imported (the step folders say which)."""
    return str(f.relative_to(path)) if Path(path).is_dir() else f.name


def _objects(f: Path, bad: list[BadRow]):
    """(line, object) for each JSON object line of `f` (ingest's reader); other lines go to `bad`."""
    records, broken = read_jsonl(f)
    bad += [BadRow(str(f), b.line, b.problem) for b in broken]  # the path: prime-rl's files share one name
    for n, obj in records:
        if isinstance(obj, dict):
            yield n, obj
        else:
            bad.append(BadRow(str(f), n, "not a JSON object"))


def _reward(v: Any) -> float | None:
    """`v` as a reward, or None: not a number, not finite, or beyond ±MAX_REWARD (an int of any size too)."""
    if isinstance(v, bool) or not isinstance(v, int | float) or isinstance(v, float) and not math.isfinite(v):
        return None
    return float(v) if abs(v) <= MAX_REWARD else None


def _text(v: Any) -> str | None:
    """A prompt as text: a string, or chat messages joined as 'role: content' lines."""
    if isinstance(v, str):
        return v
    if isinstance(v, list) and v and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in v):
        return "\n".join(f"{m.get('role', 'user')}: {m['content']}" for m in v)
    return None


def _check(prompt: object, completion: object, reward: object, step: object) -> str | None:
    if _text(prompt) is None or not _text(prompt).strip():
        return "prompt missing or not text"
    if not isinstance(completion, str):
        return "completion missing or not a string"
    if _reward(reward) is None:
        finite = isinstance(reward, int | float) and not isinstance(reward, bool) and (
            isinstance(reward, int) or math.isfinite(reward))
        shown = repr(reward) if len(repr(reward)) <= 30 else f"{repr(reward)[:12]}... ({len(repr(reward))} digits)"
        return f"reward {shown} is beyond ±{MAX_REWARD:g}" if finite else f"reward {shown} is not a finite number"
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"step {step!r} is not a non-negative integer"
    return None


def read_verl(path: str) -> tuple[list[DumpRow], list[BadRow]]:
    rows, bad = [], []
    for f in dump_files("verl", path):
        stem_step = int(f.stem) if f.stem.isdigit() else None
        for n, obj in _objects(f, bad):
            step = obj.get("step", stem_step)
            problem = _check(obj.get("input"), obj.get("output"), obj.get("score"), step)
            if problem is not None:
                bad.append(BadRow(str(f), n, problem))
                continue
            gts = obj.get("gts")
            extra = {k: v for k, v in obj.items() if k not in ("input", "output", "gts", "score", "step")}
            rows.append(DumpRow(step, _text(obj["input"]), obj["output"], float(obj["score"]),
                                "" if gts is None else str(gts), extra=extra, file=_name(f, path), line=n))
    return rows, bad


TRL_FIXED = ("step", "prompt", "completion", "advantage")


def read_trl(path: str, reward_column: str | None = None) -> tuple[list[DumpRow], list[BadRow]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows, bad = [], []
    for f in dump_files("trl", path):
        try:
            t = pq.read_table(f)
        except Exception as e:  # noqa: BLE001 (any unreadable file is one bad row naming it)
            bad.append(BadRow(str(f), None, f"not a readable Parquet file ({type(e).__name__})"))
            continue
        missing = [c for c in ("step", "prompt", "completion") if c not in t.column_names]
        rewards = [reward_column] if reward_column else [
            c for c in t.column_names if c not in TRL_FIXED and pa.types.is_floating(t.schema.field(c).type)]
        if reward_column and reward_column not in t.column_names:
            missing.append(reward_column)
        if missing or not rewards:
            bad.append(BadRow(str(f), None, f"no column {', '.join(missing) or 'with rewards'}"))
            continue
        for n, r in enumerate(t.to_pylist(), 1):
            parts = [r[c] for c in rewards]
            missing = [v is None or (isinstance(v, float) and math.isnan(v)) for v in parts]
            wrong = [v for m, v in zip(missing, parts) if not m and _reward(v) is None]  # inf, 1e308: named
            total = None if all(missing) else wrong[0] if wrong \
                else sum(v for m, v in zip(missing, parts) if not m)  # every reward NaN: TRL could not score it
            problem = _check(r["prompt"], r["completion"], total, r["step"])
            if problem is not None:
                bad.append(BadRow(str(f), n, problem))
                continue
            extra = {k: v for k, v in r.items() if k not in ("step", "prompt", "completion")}
            rows.append(DumpRow(r["step"], _text(r["prompt"]), r["completion"], total, extra=extra, file=f.name,
                                line=n))
    return rows, bad


_STEP_DIR = re.compile(r"^step_(\d+)$")


def _prime_rl_files(path: str) -> list[Path]:
    files = _files(path, "traces.jsonl")
    if Path(path).is_dir():  # everything generated for training, not the trained-on subset or evaluations
        files = ([f for f in files if f.parent.name == "all" and f.parent.parent.name == "train"]
                 or [f for f in files if f.parent.name == "all"] or files)  # `effective` repeats part of `all`
    return files


def read_prime_rl(path: str) -> tuple[list[DumpRow], list[BadRow]]:
    rows, bad = [], []
    for f in _prime_rl_files(path):
        folder_step = next((int(m.group(1)) for p in f.parents if (m := _STEP_DIR.match(p.name))), None)
        for n, ep in _objects(f, bad):
            try:
                traces = ep.get("traces") or []
                if not traces:
                    bad.append(BadRow(str(f), n, "a failed episode: no trace (errors: "
                                      f"{json.dumps(ep.get('errors'))[:200]})"))
                    continue
                trace = next((t for t in traces if (t.get("agent") or {}).get("trainable", True)), traces[0])
                data = ep.get("task", {}).get("data", {})
                prompt = data.get("prompt")
                if prompt is None:  # the first non-sampled user message
                    prompt = next(nd["message"]["content"] for nd in trace["nodes"]
                                  if not nd.get("sampled") and nd["message"].get("role") == "user")
                completion = "".join(nd["message"].get("content") or "" for nd in trace["nodes"]
                                     if nd.get("sampled"))  # a tool-call-only turn has no content
                scored = [r for r in (trace.get("rewards") or {}).values() if r is not None]  # None: not run
                reward = sum(r["score"] * r.get("weight", 1.0) for r in scored) \
                    if all(_reward(r.get("score")) is not None for r in scored) else None
                step = ep.get("run", {}).get("work", {}).get("step", folder_step)
                usage = [c.get("usage", {}).get("completion_tokens") for c in trace.get("calls", [])]
            except (KeyError, IndexError, TypeError, StopIteration, AttributeError) as e:
                bad.append(BadRow(str(f), n, f"not a verifiers episode ({type(e).__name__}: {e})"))
                continue
            problem = _check(prompt, completion, reward, step)
            if problem is not None:
                bad.append(BadRow(str(f), n, problem))
                continue
            answer = data.get("answer")
            tokens = sum(usage) if usage and all(isinstance(u, int) for u in usage) else None
            extra = {"episode": ep.get("id"), "task_key": ep.get("task", {}).get("key"),
                     "rewards": trace.get("rewards"), "stop": trace.get("stop_condition")}
            rows.append(DumpRow(step, _text(prompt), completion, float(reward), "" if answer is None else str(answer),
                                group=str(ep.get("group", {}).get("id")) if ep.get("group") else None,
                                n_tokens=tokens, extra=extra, file=_name(f, path), line=n))
    return rows, bad


def _plain_file(path: str) -> list[Path]:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{path}: no such file")
    if p.suffix not in (".jsonl", ".parquet"):
        raise ValueError(f"{path}: a plain dump is a .jsonl or .parquet file")
    return [p]


def read_plain(path: str) -> tuple[list[DumpRow], list[BadRow]]:
    (p,), rows, bad = _plain_file(path), [], []
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            records = list(enumerate(pq.read_table(p).to_pylist(), 1))
        except Exception as e:  # noqa: BLE001 (an unreadable file is one error naming it)
            raise ValueError(f"{path}: not a readable Parquet file ({type(e).__name__})") from None
    else:
        records = list(_objects(p, bad))
    for n, r in records:
        problem = _check(r.get("prompt"), r.get("completion"), r.get("reward"), r.get("step", 0))
        if problem is None and r.get("group") is not None and not isinstance(r["group"], str | int):
            problem = "group is not a string or integer"
        if problem is not None:
            bad.append(BadRow(str(p), n, problem))
            continue
        extra = {k: v for k, v in r.items() if k not in ("prompt", "completion", "reward", "step", "group", "answer")}
        rows.append(DumpRow(r.get("step", 0), _text(r["prompt"]), r["completion"], float(r["reward"]),
                            "" if r.get("answer") is None else str(r["answer"]),
                            group=None if r.get("group") is None else str(r["group"]), extra=extra, file=p.name,
                            line=n))
    return rows, bad


def read_dump(fmt: str, path: str, reward_column: str | None = None) -> tuple[list[DumpRow], list[BadRow]]:
    """The rows of the dump at `path` in format `fmt` (one of FORMATS), and its bad rows."""
    if fmt == "verl":
        return read_verl(path)
    if fmt == "trl":
        return read_trl(path, reward_column)
    if fmt == "prime-rl":
        return read_prime_rl(path)
    if fmt == "plain":
        return read_plain(path)
    raise ValueError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")


def dump_files(fmt: str, path: str) -> list[Path]:
    """The files the reader of `fmt` reads from `path`, sorted (a prime-rl folder's `train/all` only)."""
    if fmt == "prime-rl":
        return _prime_rl_files(path)
    if fmt == "plain":
        return _plain_file(path)
    patterns = {"verl": "*.jsonl", "trl": "completions_*.parquet"}
    if fmt not in patterns:
        raise ValueError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    return _files(path, patterns[fmt])
