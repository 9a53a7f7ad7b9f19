"""`refinery sql`'s output formats: a table for people, CSV and JSON for programs; every DuckDB type prints.

The rows arrive as a stream of Arrow batches (storage/query.py `query_batches`) holding each column twice, its
value and DuckDB's own text for it. Choices, and why:
- Cells are DuckDB's text (`CAST(x AS VARCHAR)`), not Python's or polars' rendering of the value: DuckDB has a
  text for every one of its types, where Python cannot convert an infinite timestamp or date and polars
  cannot import an interval or a union (it panics, past any `except Exception`). NULL is `null` in the table
  and an empty cell in CSV.
- The table shows at most `limit` rows (default 1,000; `--limit 0` shows all) and then says how many more
  there are; it is built from the rows it shows only, so 100k rows cost a count, not 100 MB of text. CSV and
  JSON stream every row batch by batch (or the first `--limit`, with the rest counted on stderr, so the output
  stays valid data).
- JSON is always valid: a NaN or infinite float is `null`; numbers, strings, booleans and lists and structs of
  them are JSON values (a HUGEINT, such as a `sum` of integers, is a JSON number); every other type
  (decimals, dates, times, intervals, blobs, maps, unions, UUIDs, enums, bit strings, and VARINTs, whose
  digits are unbounded) is DuckDB's text for it, exact where a float would round: a blob is a string with
  each byte outside printable ASCII as `\\xHH` (`\\xFF\\x00`). Repeated column names (`SELECT a.x, b.x`)
  become `x`, `x_1` as JSON keys; the table and CSV keep them as they are.
- Cells wider than 100 characters are cut with `…`; a cell with line breaks (EXPLAIN's plan) spans lines.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from collections.abc import Iterator
from decimal import Decimal
from typing import TextIO

import pyarrow as pa

TABLE_ROWS = 1_000  # the table's default row cap
CELL_CHARS = 100


def write_result(result, fmt: str, limit: int | None, out: TextIO | None = None, err: TextIO | None = None) -> None:
    """Write a `QueryResult` (with text columns) as `fmt`: table, csv or json (module docstring) to `out`
    (default: stdout; the notice of rows left out to `err`, default stderr). `limit`: rows to show at most
    (None: the format's default; 0: all)."""
    out, err = out or sys.stdout, err or sys.stderr
    cap = (TABLE_ROWS if fmt == "table" else 0) if limit is None else limit
    total = [0]  # rows of the result, counted as they stream past: only the first `cap` are converted
    rows = _rows(result, fmt == "json", cap, total)
    if fmt == "table":
        shown = list(rows)
        out.write(render_table(result.names, result.types, shown) + "\n")
        more = total[0] - len(shown)
        out.write(f"({total[0]} rows)\n" if not more else
                  f"({total[0]} rows, the first {len(shown)} shown)\n{more} more rows: use --limit or --format csv\n")
        return
    write = _csv_writer(result.names, out) if fmt == "csv" else _json_writer(result.names, out)
    for row in rows:
        write(row)
    write(None)
    if cap and total[0] > cap:
        err.write(f"{total[0] - cap} more rows: use --limit 0 for all\n")


def _rows(result, json_values: bool, cap: int, total: list[int]) -> Iterator[list]:
    """The first `cap` rows (0: all), each as a list of cells: DuckDB's text (None for NULL), or JSON values
    where the column's type is one (module docstring). Every row is counted into `total[0]`; those past the
    cap are only counted (a batch's length), never converted."""
    for batch in result.batches:
        take = batch.num_rows if not cap else max(0, min(batch.num_rows, cap - total[0]))
        total[0] += batch.num_rows
        if not take:
            continue
        batch = batch.slice(0, take)
        cols = []
        for i in range(len(result.names)):
            value, text = batch.column(2 * i), batch.column(2 * i + 1)
            if json_values and pa.types.is_decimal(value.type) and value.type.scale == 0:
                # HUGEINT and UHUGEINT: from DuckDB's text, since Arrow's decimal128(38, 0) wraps a UHUGEINT
                # beyond 10**38 around (2**128 - 1 arrives as -1)
                cols.append([None if t is None else int(t) for t in text.to_pylist()])
            elif json_values and _json_native(value.type):
                cols.append([_json_safe(v) for v in value.to_pylist()])
            else:
                cols.append(text.to_pylist())
        yield from (list(r) for r in zip(*cols)) if cols else ([] for _ in range(take))


def _json_native(t: pa.DataType) -> bool:
    if (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_string(t)
            or pa.types.is_large_string(t) or pa.types.is_null(t)):
        return True
    if pa.types.is_decimal(t):
        return t.scale == 0  # HUGEINT and UHUGEINT arrive as decimal128(38, 0)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _json_native(t.value_type)
    if pa.types.is_struct(t):
        return all(_json_native(t.field(k).type) for k in range(t.num_fields))
    return False


def _json_safe(v):
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, Decimal):
        return int(v)
    if isinstance(v, list):
        return [_json_safe(x) for x in v]
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    return v


def _csv_writer(names: list[str], out: TextIO):
    w = csv.writer(out, lineterminator="\n")
    w.writerow(names)
    return lambda row: row is not None and w.writerow(row)


def _json_writer(names: list[str], out: TextIO):
    keys = unique_names(names)
    first = True

    def write(row: list | None) -> None:
        nonlocal first
        if row is None:
            out.write("[]\n" if first else "\n]\n")
            return
        out.write(("[\n " if first else ",\n ") + json.dumps(dict(zip(keys, row)), ensure_ascii=False, allow_nan=False))
        first = False

    return write


def unique_names(names: list[str]) -> list[str]:
    """`names` with repeats made unique: x, x -> x, x_1 (and x_2 ..., skipping names already taken)."""
    taken, out = set(names), []
    seen: dict[str, int] = {}
    for name in names:
        if name not in seen:
            seen[name] = 0
            out.append(name)
            continue
        k = seen[name]
        while f"{name}_{k + 1}" in taken:
            k += 1
        seen[name] = k + 1
        taken.add(f"{name}_{k + 1}")
        out.append(f"{name}_{k + 1}")
    return out


def render_table(names: list[str], types: list[str], rows: list[list[str | None]]) -> str:
    """A boxed text table: names, types, then the rows (None as `null`); cells cut at CELL_CHARS characters,
    line breaks kept as lines of the cell."""
    def lines(cell: str | None) -> list[str]:
        text = "null" if cell is None else cell
        return [ln if len(ln) <= CELL_CHARS else ln[: CELL_CHARS - 1] + "…" for ln in text.split("\n")] or [""]

    body = [[lines(c) for c in row] for row in rows]
    head = [[*lines(n), "---", t] for n, t in zip(names, types)]
    widths = [max(len(ln) for cell in [h, *(r[i] for r in body)] for ln in cell) for i, h in enumerate(head)]

    def row_text(cells: list[list[str]]) -> list[str]:
        height = max((len(c) for c in cells), default=1)
        return ["│ " + " ┆ ".join((c[k] if k < len(c) else "").ljust(w) for c, w in zip(cells, widths)) + " │"
                for k in range(height)]

    def rule(left: str, mid: str, right: str, fill: str) -> str:
        return left + mid.join(fill * (w + 2) for w in widths) + right

    if not names:
        return "(no columns)"
    return "\n".join([rule("┌", "┬", "┐", "─"), *row_text(head), rule("╞", "╪", "╡", "═"),
                      *(ln for r in body for ln in row_text(r)), rule("└", "┴", "┘", "─")])


def format_table(t: pa.Table, fmt: str = "table") -> str:
    """A small in-memory table (the run summary's) as a boxed table: Python's text for each value."""
    cols = [[None if v is None else str(v) for v in c.to_pylist()] for c in t.columns]
    rows = [list(r) for r in zip(*cols)]
    return render_table(t.column_names, [str(f.type) for f in t.schema], rows) + f"\n({t.num_rows} rows)"
