"""Reading the store: DuckDB views named like the tables, polars lazy frames, confined SQL, catalog.duckdb.

Views list the data files of landed stages explicitly (from the commit records), so a stage that is still
being written, or that crashed half-way, is never visible.
"""

from __future__ import annotations

import os
import uuid

import duckdb
import polars as pl
import pyarrow as pa

from storage.schemas import TABLES, empty_select_sql, schema
from storage.store import Store


class QueryRefused(ValueError):
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


def connect(store: Store, con: duckdb.DuckDBPyConnection | None = None) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection (in-memory unless given) with one view per table over the landed data."""
    con = con or duckdb.connect()
    if not store.local:
        con.register_filesystem(store.fs)
    records = store.records()
    for table in TABLES:
        con.execute(view_sql(store, table, store.files(table, records)))
    return con


def scan(store: Store, table: str) -> pl.LazyFrame:
    """A polars lazy frame over the landed data of `table`."""
    files = store.files(table)
    if not files:
        return pl.from_arrow(schema(table).empty_table()).lazy()
    if store.local:
        return pl.scan_parquet(files, missing_columns="insert", extra_columns="ignore")
    import pyarrow.dataset as ds  # fsspec roots: let pyarrow read through the store's filesystem

    stripped = [store.fs._strip_protocol(f) for f in files]
    # the table's schema, so that files written before a column was added read with nulls in it
    return pl.scan_pyarrow_dataset(ds.dataset(stripped, schema=schema(table), filesystem=store.fs, format="parquet"))


# Statement types the read-only interface runs; everything else (COPY, ATTACH, INSTALL, LOAD, SET, PRAGMA,
# CREATE, INSERT, UPDATE, DELETE, EXPORT, CALL, ...) is refused before it reaches the engine.
_ALLOWED = {"SELECT", "EXPLAIN"}


def confined_connection(store: Store) -> duckdb.DuckDBPyConnection:
    """An in-memory connection whose views read the store and which can read nothing else.

    Defence in depth: statements are filtered by type in `sql`, and the engine itself is locked down, so
    that even a SELECT cannot reach files outside the store (read_csv('/etc/passwd'), read_text, ...),
    install or load extensions, or change settings back.
    """
    con = duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False})
    connect(store, con)
    prefix = store.root + os.sep if store.local else store.full("")
    con.execute(f"SET allowed_directories = [{_quote(prefix)}]")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return con


def sql(store: Store, query: str) -> pa.Table:
    """Run one read-only query over the store's views. Raises QueryRefused for anything but a read."""
    if not query.strip():
        raise QueryRefused("empty query")
    con = confined_connection(store)
    try:
        try:
            statements = con.extract_statements(query)
        except duckdb.ParserException as e:
            raise QueryRefused(f"SQL syntax error: {_first_line(e)}") from None
        if len(statements) != 1:
            raise QueryRefused(f"expected exactly one statement, got {len(statements)}")
        kind = statements[0].type.name
        if kind not in _ALLOWED:
            word = statements[0].query.split(None, 1)[0].upper() if statements[0].query.strip() else kind
            raise QueryRefused(f"{word} is not allowed: the SQL interface is read-only (SELECT queries only)")
        try:
            return con.sql(query).to_arrow_table()
        except duckdb.PermissionException as e:
            raise QueryRefused(f"refused: {_first_line(e)} (queries may only read the store's tables)") from None
        except duckdb.Error as e:
            if "external access" in str(e).lower() or "not allowed" in str(e).lower():
                raise QueryRefused(f"refused: {_first_line(e)}") from None
            raise
    finally:
        con.close()


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0]


def write_catalog(store: Store) -> str:
    """Write <store>/catalog.duckdb holding the same views, so the stock duckdb CLI can open the store.

    The views name the files landed at the time of writing; `refinery catalog` refreshes them.
    """
    if not store.local:
        raise ValueError("catalog.duckdb can only be written into a local store; use `refinery sql` for URIs")
    dest = store.path("catalog.duckdb")
    tmp = store.path(f".catalog-{uuid.uuid4().hex}.duckdb")
    con = duckdb.connect(tmp)
    try:
        connect(store, con)
    finally:
        con.close()
    os.replace(tmp, dest)
    return dest
