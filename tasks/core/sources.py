"""Prompt sources: reasoning-gym generators, JSONL and Parquet files, and the row validator.

Every bad row is reported with its file, line and problem ("prompts.jsonl line 17: field 'answer' is
missing"); the caller decides whether one bad row rejects the file (the default) or is skipped.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from tasks.core.ids import prompt_id
from tasks.core.worked_solutions import with_solutions


@dataclass(frozen=True)
class Limits:
    """Size bounds, in characters, for one row's fields."""

    question: int = 16_000
    answer: int = 2_000
    solution: int = 64_000
    meta: int = 64_000


@dataclass(frozen=True)
class BadRow:
    file: str
    line: int | None  # 1-based line (JSONL) or row (Parquet); None for a problem with the whole file
    problem: str

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file} line {self.line}"
        return f"{where}: {self.problem}"


@dataclass(frozen=True)
class SourceRow:
    """One validated prompt, before it becomes a `prompts` row."""

    prompt_id: str
    text: str
    answer: str
    source: str
    solution: str | None = None
    params: str | None = None
    meta: str | None = None
    external_id: str | None = None
    line: int | None = None


class SourceError(ValueError):
    """A source that cannot be read at all: unknown generator, bad parameter, unreadable file."""


# ---- validation -----------------------------------------------------------------------------------------
def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _non_finite(v: Any) -> str | None:
    """The JSON spelling (NaN, Infinity, -Infinity) of the first non-finite float in `v`, nested or not.
    Python's json reads these non-standard tokens as floats; stored, they would become the text "nan"."""
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    if isinstance(v, dict | list | tuple):
        return next(filter(None, map(_non_finite, v.values() if isinstance(v, dict) else v)), None)
    return None


def _text_field(rec: dict, name: str, bound: int, required: bool, numbers_ok: bool = False) -> str | None:
    """The field's text, or raise ValueError naming the problem."""
    if rec.get(name) is None:
        if required:
            raise ValueError(f"field {name!r} is missing" + (" (null)" if name in rec else ""))
        return None
    v = rec[name]
    if isinstance(v, bytes):
        try:
            v = v.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"field {name!r} is not valid UTF-8 (byte {e.start})") from None
    if numbers_ok and isinstance(v, int | float) and not isinstance(v, bool):
        v = str(v)
    if not isinstance(v, str):
        kinds = "a string or a number" if numbers_ok else "a string"
        raise ValueError(f"field {name!r} must be {kinds}, got {_type_name(v)}")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"field {name!r} is not valid Unicode (it holds a lone surrogate)") from None
    if not v.strip():
        raise ValueError(f"field {name!r} is empty")
    if len(v) > bound:
        raise ValueError(f"field {name!r} is {len(v):,} characters, over the bound of {bound:,}")
    return v


def validate_record(rec: Any, source: str, limits: Limits) -> SourceRow:
    """One record (a parsed JSON object or a Parquet row) as a SourceRow, or ValueError naming the problem."""
    if not isinstance(rec, dict):
        raise ValueError(f"expected a JSON object, got {_type_name(rec)}")
    for name in ("question", "answer", "solution", "id", "meta"):
        if token := _non_finite(rec.get(name)):
            raise ValueError(f"field {name!r} holds {token}, not a finite number")
    question = _text_field(rec, "question", limits.question, required=True)
    answer = _text_field(rec, "answer", limits.answer, required=True, numbers_ok=True)
    solution = _text_field(rec, "solution", limits.solution, required=False)
    ext = rec.get("id")
    if ext is not None:
        if isinstance(ext, bool) or not isinstance(ext, str | int):
            raise ValueError(f"field 'id' must be a string or an integer, got {_type_name(ext)}")
        ext = str(ext)
    meta = rec.get("meta")
    if isinstance(meta, str):  # Parquet files usually carry meta as a JSON string column
        try:
            meta = json.loads(meta)
        except ValueError:  # not JSON, or a number over the 4,300-digit limit
            raise ValueError("field 'meta' is a string but not valid JSON") from None
    if meta is not None:
        if not isinstance(meta, dict):
            raise ValueError(f"field 'meta' must be an object, got {_type_name(meta)}")
        try:
            meta = json.dumps(meta, ensure_ascii=False, sort_keys=True, allow_nan=False)  # NaN in a meta string
            meta.encode("utf-8")
        except (TypeError, ValueError, UnicodeEncodeError) as e:
            raise ValueError(f"field 'meta' cannot be stored as JSON: {e}") from None
        if len(meta) > limits.meta:
            raise ValueError(f"field 'meta' is {len(meta):,} characters as JSON, over the bound of {limits.meta:,}")
    return SourceRow(
        prompt_id=prompt_id(question, answer, source),
        text=question,
        answer=answer.strip(),
        source=source,
        solution=solution,
        meta=meta,
        external_id=ext,
    )


def validate_records(
    records: list[tuple[int, Any]], file: str, source: str, limits: Limits
) -> tuple[list[SourceRow], list[BadRow]]:
    """Validate (line, record) pairs. A repeated `id` must carry the same content as its first use."""
    good: list[SourceRow] = []
    bad: list[BadRow] = []
    first_by_id: dict[str, SourceRow] = {}
    for line, rec in records:
        try:
            row = validate_record(rec, source, limits)
        except ValueError as e:
            bad.append(BadRow(file, line, str(e)))
            continue
        row = dataclasses.replace(row, line=line)
        if row.external_id is not None:
            first = first_by_id.setdefault(row.external_id, row)
            if first.prompt_id != row.prompt_id:
                bad.append(BadRow(file, line, f"id {row.external_id!r} was used on line {first.line} with different content"))
                continue
        good.append(row)
    return good, bad


# ---- files ----------------------------------------------------------------------------------------------
MAX_DEPTH = 100  # levels of JSON arrays and objects in one line; a prompt's meta or a trainer's record has few
TOO_DEEP = f"arrays or objects nested deeper than {MAX_DEPTH} levels"


def read_jsonl(path: Path) -> tuple[list[tuple[int, Any]], list[BadRow]]:
    """Parse a JSONL file line by line, keeping undecodable or unparsable lines as BadRows. A UTF-8 byte order
    mark at the start (Windows editors write one) is skipped. A line Python cannot hold is bad, not the file:
    a number over its 4,300-digit limit for reading an integer, or nesting deeper than `MAX_DEPTH` (validators
    and import's JSON writers recurse per level: past Python's recursion limit the whole command would stop)."""
    records, bad = [], []
    for i, raw in enumerate(path.read_bytes().removeprefix(codecs.BOM_UTF8).split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            problem = f"invalid UTF-8 at byte {e.start} of the line"
        except json.JSONDecodeError as e:
            problem = f"not valid JSON: {e.msg} at column {e.colno}"
        except ValueError as e:  # int(): "Exceeds the limit (4300 digits) for integer string conversion"
            found = re.search(r"limit \((\d+) digits\).*value has (\d+) digits", str(e))
            problem = (f"a number too long to read: {int(found[2]):,} digits, over Python's limit of {int(found[1]):,}"
                       if found else f"a number too long to read ({str(e).split(';')[0]})")
        except RecursionError:
            problem = TOO_DEEP
        else:
            if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH or not _too_deep(rec):  # the count: a cheap bound
                records.append((i, rec))
                continue
            problem = TOO_DEEP
        bad.append(BadRow(path.name, i, problem))
    return records, bad


def _too_deep(value: Any) -> bool:
    """Is `value` nested deeper than MAX_DEPTH? Walked with a stack, not recursion, for the reason above."""
    todo = [(value, 1)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, dict | list):
            if depth > MAX_DEPTH:
                return True
            todo += [(c, depth + 1) for c in (v.values() if isinstance(v, dict) else v)]
    return False


def read_parquet(path: Path) -> tuple[list[tuple[int, Any]], list[BadRow]]:
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a corrupt or foreign file
        raise SourceError(f"{path.name}: not a readable Parquet file: {e}") from None
    missing = [c for c in ("question", "answer") if c not in table.column_names]
    if missing:
        return [], [BadRow(path.name, None, f"column(s) missing: {', '.join(missing)}")]
    rows = table.to_pylist()
    for r in rows:  # a Parquet map/struct arrives as a list of pairs or a dict; meta must be an object
        if isinstance(r.get("meta"), list):
            r["meta"] = dict(r["meta"])
    return list(enumerate(rows, start=1)), []


def file_rows(path: str | Path, source: str | None, limits: Limits) -> tuple[list[SourceRow], list[BadRow]]:
    p = Path(path)
    if not p.is_file():
        raise SourceError(f"{path}: no such file")
    suffix = p.suffix.lower()
    if suffix not in (".jsonl", ".parquet"):
        raise SourceError(f"{path}: unsupported file type {suffix!r}; use .jsonl or .parquet")
    records, bad = read_jsonl(p) if suffix == ".jsonl" else read_parquet(p)
    if not records and not bad:  # an empty or blank-only file: say so, instead of landing an empty stage
        raise SourceError(f"{path}: no rows (the file is empty or holds only blank lines)")
    good, invalid = validate_records(records, p.name, source or p.name, limits)
    return good, sorted(bad + invalid, key=lambda b: (b.line or 0))


# ---- reasoning-gym --------------------------------------------------------------------------------------
def rg_config_fields(name: str) -> dict[str, Any]:
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        import difflib

        near = difflib.get_close_matches(name, DATASETS, n=1)
        if near:
            raise SourceError(f"unknown reasoning-gym task {name!r} (did you mean {near[0]!r}?)")
        some = sorted(k for k in DATASETS if name[:3] in k)[:8] or sorted(DATASETS)[:8]
        raise SourceError(f"unknown reasoning-gym task {name!r}; for example: {', '.join(some)}")
    _, cfg_cls = DATASETS[name]
    return {f.name: f.default for f in dataclasses.fields(cfg_cls) if f.name not in ("seed", "size")}


def parse_param(name: str, key: str, value: Any) -> Any:
    fields = rg_config_fields(name)
    if key not in fields:
        raise SourceError(f"rg:{name} has no parameter {key!r}; its parameters are: {', '.join(fields)}")
    if not isinstance(value, str):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    default = fields[key]
    if isinstance(default, tuple) and isinstance(parsed, list):
        parsed = tuple(parsed)
    if isinstance(default, tuple) and isinstance(parsed, str):
        parsed = tuple(x.strip() for x in parsed.split(","))
    return parsed


def rg_rows(name: str, size: int, seed: int, params: dict[str, Any], solutions: bool = True) -> list[SourceRow]:
    """`size` prompts of reasoning-gym's `name` at difficulty `params`; `solutions`: with worked solutions."""
    import reasoning_gym

    if size < 1:
        raise SourceError(f"--size must be at least 1, got {size}")
    rg_config_fields(name)  # names an unknown task before reasoning-gym's own, vaguer error
    parsed = {k: parse_param(name, k, v) for k, v in params.items()}
    try:
        ds = reasoning_gym.create_dataset(name, size=size, seed=seed, **parsed)
    except (AssertionError, ValueError, TypeError) as e:
        raise SourceError(f"rg:{name} rejected parameters {parsed}: {e or 'invalid value'}") from None
    source, params_json = f"rg:{name}", json.dumps({**parsed, "seed": seed, "size": size}, sort_keys=True, default=list)
    rows = []
    for i, entry in enumerate(ds):
        q, a = entry["question"], str(entry["answer"])
        meta = json.dumps(entry.get("metadata", {}), sort_keys=True, default=str)
        rows.append(SourceRow(prompt_id(q, a, source), q, a, source, params=params_json, meta=meta, line=i + 1))
    return with_solutions(name, rows) if solutions else rows  # tasks/core/worked_solutions.py: None where none
