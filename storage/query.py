"""Reading the store: DuckDB views named like the tables, polars lazy frames, confined SQL, catalog.duckdb.

Views list the data files of landed stages explicitly (from the commit records), so a stage that is still
being written, or that crashed half-way, is never visible.

User SQL (`sql`, behind `refinery sql`) is read-only by two independent layers:

1. A filter on DuckDB's own parse (storage/sql_filter.py): exactly one statement that is a query, or an
   EXPLAIN of one, and no table function that runs SQL from a string or changes the engine's state.
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

What one query may cost (memory, threads, seconds) is storage/sql_budget.py's.

Every failure is a `QueryError` (a ValueError) with a one-line message: refusals are `QueryRefused`;
DuckDB's errors keep their first line and a "Did you mean" / "Candidate bindings" hint when it gives one.
Both come from storage/sql_filter.py and stay importable from here.

catalog.duckdb names its files relative to the store folder, so a copied or moved store's catalog works;
DuckDB resolves relative paths against its working directory, so it is opened from inside the store
(`cd <store> && duckdb -readonly catalog.duckdb`), or after `SET file_search_path = '<store>'`.
"""

from __future__ import annotations

import functools
import operator
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.dataset as ds

from storage.schemas import TABLES, empty_select_sql, schema
from storage.sql_budget import Budget, QueryResult, budgeted, duckdb_errors, machine_memory, sql_limits
from storage.sql_filter import (
    READ_ONLY_HINT,
    QueryError,
    QueryRefused,
    check_read_only,
    first_line_and_hint,
    first_word,
)
from storage.store import Store

__all__ = ["QueryError", "QueryRefused", "QueryResult", "check_read_only", "confined_connection", "connect",
           "first_line_and_hint", "machine_memory", "query_batches", "scan", "sql", "sql_limits", "view_sql",
           "write_catalog"]


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



def table_rows_with_schema(store: Store, table: str, columns: list[str], run_id: str | None = None,
                           round: int | None = None) -> pl.DataFrame:
    """`columns` of `table`'s landed rows (of `run_id`'s round `round` when given), read with the table's
    schema: a column added after some files were written reads as null there (scan's polars reader takes its
    columns from the first file, so a store whose first file predates a column would hide it everywhere)."""
    data = _dataset(store, table)
    if isinstance(data, pa.Table):  # no file landed: the empty table
        return pl.from_arrow(data.select(columns))
    conds = [ds.field(name) == value for name, value in (("run_id", run_id), ("round", round)) if value is not None]
    return pl.from_arrow(data.to_table(columns=columns, filter=functools.reduce(operator.and_, conds) if conds else None))


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


def referenced_tables(query: str) -> set[str] | None:
    """The store tables `query` names (DuckDB's own parse), or None when that cannot be told (DuckDB binds
    some queries to answer, which fails without the tables): then every table counts as named."""
    try:
        with duckdb.connect() as scratch:
            return {name.lower() for name in scratch.get_table_names(query)} & set(TABLES)
    except duckdb.Error:
        return None


def confined_connection(store: Store, tables: set[str] | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory connection with one view per table over the landed data, which can touch no file, within
    `sql_limits`. Only `tables` (default: all) are read from the store, each landed file checked
    (storage/integrity.py); the others are empty tables of their schema, so that a query's name for them still
    binds (SHOW TABLES, a "Did you mean" for a typo) without listing or checking their files."""
    con = duckdb.connect(config={
        "enable_external_access": False,
        "autoinstall_known_extensions": False,
        "autoload_known_extensions": False,
        "python_enable_replacements": False,  # no reaching Python variables by name
        "temp_directory": "",  # no spilling to disk: nothing is written, ever
        **sql_limits(),
    })
    try:
        con.execute("SET disabled_filesystems = 'LocalFileSystem'")  # only settable once the database runs
        con.execute("SET enable_progress_bar = false")  # DuckDB's bar would land in the CSV or JSON on stdout
        records = store.records()
        for table in TABLES:
            read = tables is None or table in tables
            con.register(table, _dataset(store, table, records) if read else schema(table).empty_table())
        con.execute("SET lock_configuration = true")
    except BaseException:
        con.close()
        raise
    return con


def sql(store: Store, query: str, timeout_s: float | None = None) -> pa.Table:
    """Run one read-only query over the store's tables. Raises QueryRefused for anything but a read and
    QueryError for a query that fails or runs past `timeout_s`, both with a one-line message."""
    with query_batches(store, query, timeout_s, text=False) as result:
        return pa.Table.from_batches(list(result.batches), schema=result.schema)


@contextmanager
def query_batches(store: Store, query: str, timeout_s: float | None = None, text: bool = True,
                  batch_rows: int = 10_000) -> Iterator[QueryResult]:
    """Run one read-only query and stream its result (`QueryResult`) while the block runs; the query is
    interrupted once DuckDB has worked on it `timeout_s` seconds in all (planning, running and fetching each
    batch; not the time the caller spends writing a batch out, so a slow pipe or a large CSV is not cut
    short). Every failure is a one-line QueryRefused or QueryError, as in `sql`."""
    check_read_only(query)
    con = confined_connection(store, referenced_tables(query))
    budget = Budget(con, timeout_s)
    try:
        with duckdb_errors(query, timeout_s), budget.running():
            rel = con.sql(query)
            if rel is None:  # not a query after all: the filter should have caught it
                raise QueryRefused(f"{first_word(query)} is not allowed; {READ_ONLY_HINT}")
            names, types = list(rel.columns), [str(t) for t in rel.types]
            if text:
                rel = rel.project(", ".join(f"#{i + 1} AS v{i}, #{i + 1}::VARCHAR AS t{i}" for i in range(len(names))))
            reader = rel.to_arrow_reader(batch_rows)  # runs a blocking query (an aggregate, a sort) to its end
        # outside the error mapping: what the caller's block raises (a closed pipe is an OSError) is its own
        yield QueryResult(names, types, reader.schema, budgeted(reader, query, timeout_s, budget))
    finally:
        con.close()


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
