"""Reading the store: DuckDB views named like the tables, polars lazy frames, confined SQL, catalog.duckdb.

Views list the data files of landed stages explicitly (from the commit records), so a stage that is still
being written, or that crashed half-way, is never visible.

User SQL (`sql`, behind `refinery sql`) is read-only by two independent layers:

1. A filter on DuckDB's own parse. The text must be exactly one statement of type SELECT (which covers
   WITH, VALUES, TABLE, FROM-first, UNPIVOT, SUMMARIZE, DESCRIBE, SHOW and PIVOT with an IN list), or a
   PIVOT that DuckDB splits into several statements (MULTI) that is a query: it still parses as a single
   statement when wrapped as `SELECT * FROM (<text>)`, which nothing but a query does, or an EXPLAIN
   [ANALYZE] whose target, re-parsed on its own, is one of those. Everything else (COPY, EXPLAIN COPY,
   ATTACH, DDL, DML, SET, PRAGMA, CALL, EXPORT, PREPARE, ...) is refused. Table functions that run SQL from a
   string (`query`, `query_table`, `json_execute_serialized_sql`) or change the engine's state
   (`checkpoint`, `enable_logging`, ...) are refused wherever they appear, found with DuckDB's tokenizer.
2. The connection cannot touch a file at all. Each view is a registered pyarrow dataset over exactly the
   landed part files of its table (pyarrow reads them, local or through the store's fsspec filesystem);
   DuckDB itself runs with its local filesystem disabled, external access off, no spill directory
   (`temp_directory = ''`: a query that outgrows memory fails rather than writing), no extension
   autoloading, no Python replacement scans, and the configuration locked. So even a statement that slipped
   past the filter could not read Prefect's database, `.locks/`, `.tmp/`, `_landed/` or `catalog.duckdb`,
   nor write anywhere. Cost (benchmarks/sql_confined.py, 1M rollouts, 2 busy cores): 0.9-1.9x the time of
   views over `read_parquet`, a few tenths of a second. A read-only fsspec filesystem registered in DuckDB
   (the other design evaluated, same guarantee) was no faster (1.0-1.8x) and failed intermittently with
   "Out of buffer" inside DuckDB's fsspec bridge.

Every failure is a `QueryError` (a ValueError) with a one-line message: refusals are `QueryRefused`;
DuckDB's errors keep their first line and a "Did you mean" / "Candidate bindings" hint when it gives one.

catalog.duckdb names its files relative to the store folder, so a copied or moved store's catalog works;
DuckDB resolves relative paths against its working directory, so it is opened from inside the store
(`cd <store> && duckdb -readonly catalog.duckdb`), or after `SET file_search_path = '<store>'`.
"""

from __future__ import annotations

import os
import threading
import uuid

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.dataset as ds

from storage.schemas import TABLES, empty_select_sql, schema
from storage.store import Store


class QueryError(ValueError):
    """A query failed; the message is one line that names the problem."""


class QueryRefused(QueryError):
    """A query asked for something the read-only SQL interface does not allow."""


def _quote(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def view_sql(store: Store, table: str, files: list[str]) -> str:
    if not files:
        return f'CREATE OR REPLACE VIEW "{table}" AS {empty_select_sql(table)}'
    cols = ", ".join(f'"{f.name}"' for f in schema(table))
    listing = "[" + ", ".join(_quote(f) for f in files) + "]"
    # Files written before a column was added still read, with nulls in the new column: union_by_name across
    # the files, and a union by name with the typed empty row set for a column that no file has yet.
    return (
        f'CREATE OR REPLACE VIEW "{table}" AS SELECT {cols} FROM ({empty_select_sql(table)} UNION ALL BY NAME '
        f"SELECT * FROM read_parquet({listing}, union_by_name = true, hive_partitioning = false))"
    )


def connect(
    store: Store, con: duckdb.DuckDBPyConnection | None = None, relative: bool = False
) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection (in-memory unless given) with one view per table over the landed data.

    For the project's own code (reports, lineage): it can read any file. User SQL goes through `sql`.
    With `relative`, views name their files relative to the store folder (for catalog.duckdb)."""
    con = con or duckdb.connect()
    if not store.local:
        con.register_filesystem(store.fs)
    records = store.records()
    for table in TABLES:
        files = store.files(table, records)
        if relative:
            files = [f[len(store.root) + 1 :] for f in files]
        con.execute(view_sql(store, table, files))
    return con


def scan(store: Store, table: str) -> pl.LazyFrame:
    """A polars lazy frame over the landed data of `table`."""
    files = store.files(table)
    if not files:
        return pl.from_arrow(schema(table).empty_table()).lazy()
    if store.local:
        return pl.scan_parquet(files, missing_columns="insert", extra_columns="ignore")
    # fsspec roots: pyarrow reads through the store's filesystem, with the table's schema
    return pl.scan_pyarrow_dataset(_dataset(store, table, files=files))


# ---- layer 1: the statement filter -----------------------------------------------------------------------

# Functions refused wherever they appear: they run SQL given as a string (which the filter cannot see), scan
# Python memory by pointer, or change the engine's state (logging, profiling, grammar, checkpoints).
_REFUSED_FUNCTIONS = frozenset({
    "query", "query_table", "json_execute_serialized_sql",
    "checkpoint", "force_checkpoint", "enable_logging", "disable_logging", "truncate_duckdb_logs",
    "enable_profiling", "disable_profiling", "write_log", "add_grammar_extension", "remove_grammar_extension",
    "create_external_resource", "register_external_resource", "register_external_resource_type",
    "deregister_external_resource", "destroy_external_resource",
    "arrow_scan", "arrow_scan_dumb", "python_arrow_scan", "pandas_scan", "python_map_function",
    "nextval", "setval", "setseed",
})
_READ_HINT = "the SQL interface is read-only: SELECT, WITH, PIVOT, SUMMARIZE, DESCRIBE, SHOW, EXPLAIN SELECT"


_parser_lock = threading.Lock()
_parser_con: duckdb.DuckDBPyConnection | None = None


def _statements(text: str) -> list:
    """DuckDB's parse of `text`, on one shared connection that never executes anything (a new in-memory
    database costs tens of milliseconds; parsing costs well under one)."""
    global _parser_con
    with _parser_lock:
        if _parser_con is None:
            _parser_con = duckdb.connect()
        return _parser_con.extract_statements(text)


def _parse(text: str) -> list:
    try:
        return _statements(text)
    except duckdb.ParserException as e:
        raise QueryError(f"SQL syntax error: {first_line_and_hint(e)}") from None
    except (duckdb.Error, ValueError) as e:  # e.g. a statement type the Python API cannot name
        raise QueryRefused(f"not allowed: {first_line_and_hint(e)}; {_READ_HINT}") from None


def _tokens(text: str) -> list[tuple[str, str]]:
    """DuckDB's own tokens of `text` as (kind, text), comments dropped."""
    try:
        raw = duckdb.tokenize(text)
    except Exception as e:  # the tokenizer rejects what the parser would too
        raise QueryError(f"SQL syntax error: {first_line_and_hint(e)}") from None
    out = []
    for i, (pos, kind) in enumerate(raw):
        end = raw[i + 1][0] if i + 1 < len(raw) else len(text)
        if kind.name != "comment":
            out.append((kind.name, text[pos:end].strip()))
    return out


def _positions(text: str) -> list[int]:
    return [pos for pos, kind in duckdb.tokenize(text) if kind.name != "comment"]


def _first_word(text: str) -> str:
    tokens = _tokens(text)
    return tokens[0][1].upper() if tokens else "?"


def _name(statement) -> str:
    """What to call a refused statement: its first word (COPY, ATTACH, CHECKPOINT, ...), or DuckDB's type
    for one that opens with WITH or a parenthesis (WITH x AS (...) INSERT ... is an INSERT)."""
    word = _first_word(statement.query)
    if word in ("WITH", "(") and statement.type.name != "MULTI":
        return statement.type.name.replace("_", " ")
    return word


def _is_query(statement) -> bool:
    """Is this parsed statement a read: SELECT, or a multi-statement PIVOT that is a query?"""
    kind = statement.type.name
    if kind == "SELECT":
        return True
    if kind == "MULTI":  # PIVOT without an IN list: DuckDB adds a CREATE TYPE for the pivot values first
        try:
            wrapped = _statements(f"SELECT * FROM (\n{statement.query}\n)")
        except (duckdb.Error, ValueError):
            return False  # COPY (PIVOT ...) TO, CREATE TABLE AS PIVOT, ...: not a query
        return len(wrapped) == 1 and wrapped[0].type.name in ("SELECT", "MULTI")
    return False


def _explain_targets(text: str) -> list[str]:
    """The statement an EXPLAIN [ANALYZE] [(options)] names, under each reading of its optional parts."""
    positions, tokens = _positions(text), _tokens(text)
    i = 1  # after EXPLAIN
    if i < len(tokens) and tokens[i][1].upper() in ("ANALYZE", "ANALYSE"):
        i += 1
    targets = [text[positions[i]:]] if i < len(tokens) else []
    if i < len(tokens) and tokens[i][1] == "(":  # EXPLAIN (FORMAT json) ...: skip the balanced option list
        depth = 0
        for j in range(i, len(tokens)):
            depth += tokens[j][1].count("(") - tokens[j][1].count(")")
            if depth <= 0:
                if j + 1 < len(tokens):
                    targets.append(text[positions[j + 1]:])
                break
    return targets


def check_read_only(query: str) -> None:
    """Raise QueryRefused unless `query` is exactly one read (see the module docstring), QueryError if it
    does not parse. Does not touch the store."""
    if not query.strip():
        raise QueryRefused("empty query")
    statements = _parse(query)
    if len(statements) != 1:
        raise QueryRefused(f"expected exactly one statement, got {len(statements)}")
    statement = statements[0]
    kind = statement.type.name
    if kind == "EXPLAIN" or (kind == "MULTI" and _first_word(statement.query) == "EXPLAIN"):  # EXPLAIN PIVOT
        readings = []
        for target in _explain_targets(statement.query):
            try:
                parsed = _statements(target)
            except (duckdb.Error, ValueError):
                continue
            if len(parsed) == 1:
                readings.append((target, parsed[0]))
        if not readings:
            raise QueryRefused(f"EXPLAIN of something other than a query is not allowed; {_READ_HINT}")
        for _, parsed in readings:
            if not _is_query(parsed):
                raise QueryRefused(f"EXPLAIN {_name(parsed)} is not allowed; {_READ_HINT}")
    elif not _is_query(statement):
        raise QueryRefused(f"{_name(statement)} is not allowed; {_READ_HINT}")
    tokens = _tokens(query)
    for (kind, word), (_, after) in zip(tokens, tokens[1:]):
        name = word.strip('"').lower()
        if kind in ("identifier", "keyword") and name in _REFUSED_FUNCTIONS and after.startswith("("):
            raise QueryRefused(f"{name}() is not allowed; {_READ_HINT}")


# ---- layer 2: a connection that can read the landed data and nothing else ---------------------------------

def _dataset(store: Store, table: str, records: list[dict] | None = None,
             files: list[str] | None = None) -> ds.Dataset | pa.Table:
    """The landed part files of `table` (listed from `records`, unless given) as a pyarrow dataset, read with
    the table's schema (so files written before a column was added read with nulls in it)."""
    files = store.files(table, records) if files is None else files
    if not files:
        return schema(table).empty_table()
    if store.local:
        return ds.dataset(files, schema=schema(table), format="parquet")
    stripped = [store.fs._strip_protocol(f) for f in files]
    return ds.dataset(stripped, schema=schema(table), format="parquet", filesystem=store.fs)


def confined_connection(store: Store) -> duckdb.DuckDBPyConnection:
    """An in-memory connection with one view per table over the landed data, which can touch no file."""
    con = duckdb.connect(config={
        "enable_external_access": False,
        "autoinstall_known_extensions": False,
        "autoload_known_extensions": False,
        "python_enable_replacements": False,  # no reaching Python variables by name
        "temp_directory": "",  # no spilling to disk: nothing is written, ever
    })
    try:
        con.execute("SET disabled_filesystems = 'LocalFileSystem'")  # only settable once the database runs
        records = store.records()
        for table in TABLES:
            con.register(table, _dataset(store, table, records))
        con.execute("SET lock_configuration = true")
    except BaseException:
        con.close()
        raise
    return con


def sql(store: Store, query: str) -> pa.Table:
    """Run one read-only query over the store's tables. Raises QueryRefused for anything but a read and
    QueryError for a query that fails, both with a one-line message."""
    check_read_only(query)
    con = confined_connection(store)
    try:
        result = con.sql(query)
        if result is None:  # not a query after all: the filter should have caught it
            raise QueryRefused(f"{_first_word(query)} is not allowed; {_READ_HINT}")
        return result.to_arrow_table()
    except duckdb.PermissionException as e:
        raise QueryRefused(f"refused: {first_line_and_hint(e)} (queries may read only the store's tables)") from None
    except duckdb.Error as e:
        message = first_line_and_hint(e)
        if "configuration has been locked" in message or "external access" in message.lower():
            raise QueryRefused(f"refused: {message}") from None
        raise QueryError(message) from None
    except (pa.ArrowException, OSError) as e:  # a landed file that pyarrow cannot read
        raise QueryError(f"reading the store failed: {first_line_and_hint(e)}") from None
    finally:
        con.close()


def first_line_and_hint(e: BaseException | str) -> str:
    """DuckDB's message in one line: its first line, plus the hint line that follows when there is one."""
    lines = [line.strip() for line in str(e).strip().splitlines()]
    out = lines[0] if lines else type(e).__name__
    if len(lines) > 1 and lines[1].startswith(("Did you mean", "Candidate bindings")):
        out += " " + lines[1]
    return out


def write_catalog(store: Store) -> str:
    """Write <store>/catalog.duckdb holding the same views, so the stock duckdb CLI can open the store.

    The views name the files landed at the time of writing, relative to the store folder (so the store can
    be copied or moved); open it from inside the store. `refinery catalog` refreshes them."""
    if not store.local:
        raise ValueError("catalog.duckdb can only be written into a local store; use `refinery sql` for URIs")
    dest = store.path("catalog.duckdb")
    tmp = store.path(f".catalog-{uuid.uuid4().hex}.duckdb")
    try:
        con = duckdb.connect(tmp)
        try:
            # binding a view reads its files: resolve the relative names against the store, for this session only
            con.execute(f"SET file_search_path = {_quote(store.root)}")
            connect(store, con, relative=True)
        finally:
            con.close()
        os.replace(tmp, dest)
    finally:  # a failed build leaves no .catalog-<uuid>.duckdb (or its WAL) behind; after the replace, none is
        for leftover in (tmp, f"{tmp}.wal"):
            if os.path.exists(leftover):
                os.remove(leftover)
    return dest
