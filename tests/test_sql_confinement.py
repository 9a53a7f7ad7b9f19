"""The SQL interface reads the store's tables and nothing else, and writes nowhere.

Each attack runs against one realistic store (landed stages, commit records, Prefect's SQLite database, a
lock, a live writer's temp folder, catalog.duckdb) and a folder outside it; after each, every file's bytes
are unchanged and the tables still read. Layer 1 (the statement filter) and layer 2 (the confined
connection) are tested separately: the raw connection refuses the worst attacks with no filter in front.
"""

import hashlib
import json
import os
import sqlite3

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import prompt_rows

from storage.query import QueryError, QueryRefused, check_read_only, confined_connection, sql, write_catalog
from storage.store import Store


def _tree(root):
    """Every file under `root` with its content hash: a write, a new file or a deletion changes it."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = tmp_path_factory.mktemp("world")
    store = Store(base / "store")
    store.commit("ingest", {"prompts": prompt_rows(5)})
    store.commit("collect", {"pool": pa.table({"run_id": ["r"] * 5, "round": [0] * 5,
                                               "prompt_id": prompt_rows(5)["prompt_id"],
                                               "status": ["active"] * 5})}, run_id="r", round=0)
    prefect = base / "store" / ".prefect"
    prefect.mkdir()
    with sqlite3.connect(prefect / "prefect.db") as db:
        db.execute("CREATE TABLE secrets (k TEXT)")
        db.execute("INSERT INTO secrets VALUES ('prefect-secret')")
    live_tmp = base / "store" / ".tmp" / "0123abcd"
    live_tmp.mkdir(parents=True)
    (live_tmp / "owner.json").write_text(json.dumps({"pid": os.getpid(), "host": "h", "created": 0}))
    write_catalog(store)
    outside = base / "outside"
    outside.mkdir()
    (outside / "secret.csv").write_text("k\nsecret\n")
    part = store.files("prompts")[0]
    names = {
        "store": store.root, "out": str(outside), "part": part, "pool_part": store.files("pool")[0],
        "record": store.path("_landed", "run_id=_ingest", "round=_", "ingest.json"),
        "catalog": store.path("catalog.duckdb"), "prefect": str(prefect / "prefect.db"),
        "lock": store.path(".locks", "commit.lock"), "tmp": str(live_tmp / "owner.json"),
    }
    assert all(os.path.exists(v) for v in names.values())
    return base, store, names


# (attack, a fragment of the refusal); every one must raise QueryError and change no byte
ATTACKS = [
    # the reported hole: EXPLAIN ANALYZE runs its target, whatever it is
    ("EXPLAIN ANALYZE COPY (SELECT * REPLACE ('X' AS answer) FROM read_parquet('{part}')) TO '{part}' (FORMAT parquet)",
     "EXPLAIN COPY is not allowed"),
    ("EXPLAIN ANALYZE COPY (SELECT 'junk' AS x) TO '{record}' (FORMAT csv, HEADER false)", "EXPLAIN COPY"),
    ("EXPLAIN ANALYZE COPY (SELECT 1 AS x) TO '{catalog}' (FORMAT parquet)", "EXPLAIN COPY"),
    ("EXPLAIN ANALYZE COPY prompts TO '{pool_part}' (FORMAT parquet)", "EXPLAIN COPY"),
    ("EXPLAIN COPY (SELECT 1) TO '{part}'", "EXPLAIN COPY"),
    ("eXpLaIn   aNaLyZe\n  copy (select 1) to '{part}'", "EXPLAIN COPY"),
    ("EXPLAIN ANALYSE COPY (SELECT 1) TO '{out}/x.csv'", "EXPLAIN COPY"),
    ("EXPLAIN (FORMAT json) COPY (SELECT 1) TO '{record}'", "EXPLAIN COPY"),
    ("EXPLAIN ANALYZE COPY (PIVOT prompts ON answer USING count(*)) TO '{part}'", "EXPLAIN COPY"),
    ("EXPLAIN ANALYZE CREATE TABLE t AS SELECT 1", "EXPLAIN CREATE"),
    ("EXPLAIN ANALYZE INSERT INTO prompts SELECT * FROM prompts", "EXPLAIN INSERT"),
    ("EXPLAIN ANALYZE DELETE FROM prompts", "EXPLAIN DELETE"),
    ("EXPLAIN ANALYZE ATTACH '{catalog}' AS c", "syntax error"),
    ("EXPLAIN EXPORT DATABASE '{store}/dump'", "syntax error"),
    ("/* SELECT */ EXPLAIN ANALYZE COPY (SELECT 1) TO '{part}'", "EXPLAIN COPY"),
    # writing statements
    ("COPY prompts TO '{part}' (FORMAT parquet)", "COPY is not allowed"),
    ("COPY (SELECT 1) TO '{out}/x.csv'", "COPY"),
    ("COPY (SELECT 1) TO '{store}/_landed/run_id=_ingest/round=_/evil.json'", "COPY"),
    ("COPY prompts FROM '{out}/secret.csv'", "COPY"),
    ("COPY (PIVOT prompts ON answer USING count(*)) TO '{part}'", "COPY"),
    ("-- just a read\nCOPY prompts TO '{out}/y.parquet'", "COPY"),
    ("EXPORT DATABASE '{store}/dump'", "EXPORT"),
    ("ATTACH '{catalog}' AS cat", "ATTACH"),
    ("ATTACH '{prefect}' AS p (TYPE sqlite)", "ATTACH"),
    ("ATTACH ':memory:' AS m", "ATTACH"),
    ("DETACH memory", "DETACH"),
    ("USE memory", "USE"),
    ("CREATE TABLE t AS SELECT 1", "CREATE"),
    ("CREATE OR REPLACE VIEW prompts AS SELECT 1 AS x", "CREATE"),
    ("CREATE MACRO m() AS 1", "CREATE"),
    ("CREATE SECRET s (TYPE s3, KEY_ID 'k', SECRET 's')", "CREATE"),
    ("CREATE TABLE t AS PIVOT prompts ON answer USING count(*)", "CREATE"),
    ("DROP VIEW prompts", "DROP"),
    ("ALTER VIEW prompts RENAME TO p", "ALTER"),
    ("INSERT INTO prompts SELECT * FROM prompts", "INSERT"),
    ("WITH x AS (SELECT * FROM prompts) INSERT INTO prompts SELECT * FROM x", "INSERT is not allowed"),
    ("EXPLAIN ANALYZE WITH x AS (SELECT 1) DELETE FROM prompts", "EXPLAIN DELETE is not allowed"),
    ("UPDATE prompts SET answer = 'X'", "UPDATE"),
    ("DELETE FROM prompts", "DELETE"),
    ("MERGE INTO prompts USING prompts AS p ON true WHEN MATCHED THEN DELETE", "MERGE"),
    ("INSTALL httpfs", "INSTALL"),
    ("FORCE INSTALL sqlite", "not allowed"),
    ("LOAD httpfs", "LOAD"),
    ("SET enable_external_access = true", "SET"),
    ("SET allowed_directories = ['/']", "SET"),
    ("RESET lock_configuration", "RESET"),
    ("SET VARIABLE x = 1", "SET"),
    ("PRAGMA enable_profiling", "PRAGMA"),
    ("CALL checkpoint()", "CALL"),
    ("CHECKPOINT", "CHECKPOINT"),
    ("VACUUM", "VACUUM"),
    ("ANALYZE", "ANALYZE"),
    ("PREPARE p AS SELECT 1", "PREPARE"),
    ("BEGIN TRANSACTION", "BEGIN"),
    ("SELECT 1; COPY prompts TO '{out}/y.csv'", "exactly one statement"),
    ("SELECT 1 --\n; DROP VIEW prompts", "exactly one statement"),
    # SQL hidden in strings, and functions that change the engine's state
    ("SELECT * FROM query('SELECT 1')", "query() is not allowed"),
    ("SELECT * FROM \"QUERY\"('SELECT * FROM read_text(''{prefect}'')')", "query() is not allowed"),
    ("SELECT * FROM main.query /* c */ ('SELECT 1')", "query() is not allowed"),
    ("SELECT * FROM query_table('prompts')", "query_table() is not allowed"),
    ("SELECT * FROM json_execute_serialized_sql(json_serialize_sql('SELECT 1'))", "json_execute_serialized_sql()"),
    ("SELECT * FROM enable_logging(storage = 'file', storage_path = '{store}/_landed')", "enable_logging()"),
    ("SELECT write_log('x')", "write_log()"),
    ("SELECT * FROM checkpoint()", "checkpoint()"),
    ("SELECT * FROM add_grammar_extension('x')", "add_grammar_extension()"),
    ("PIVOT (FROM query('SELECT 1 AS a')) ON a", "query() is not allowed"),
    # reads of anything but the tables: refused by the connection, which has no file access at all
    ("SELECT * FROM read_text('{prefect}')", "refused"),
    ("SELECT * FROM read_blob('{prefect}')", "refused"),
    ("SELECT * FROM read_text('{lock}')", "refused"),
    ("SELECT * FROM read_json('{tmp}')", "refused"),
    ("SELECT * FROM glob('{store}/.tmp/*')", "refused"),
    ("SELECT * FROM read_json('{record}')", "refused"),
    ("SELECT * FROM read_text('{store}/_landed/*/*/*.json')", "refused"),
    ("SELECT * FROM read_blob('{catalog}')", "refused"),
    ("SELECT * FROM '{catalog}'", "refused"),
    ("SELECT * FROM read_parquet('{part}')", "refused"),
    ("SELECT * FROM parquet_metadata('{part}')", "refused"),
    ("SELECT * FROM '{out}/secret.csv'", "refused"),
    ("SELECT * FROM read_csv('{store}/../outside/secret.csv')", "refused"),
    ("SELECT * FROM read_csv('/etc/passwd')", "refused"),
    ("SELECT * FROM read_text('file:///etc/passwd')", "refused"),
    ("SELECT * FROM sniff_csv('/etc/passwd')", "refused"),
    ("SELECT * FROM glob('/etc/*')", "refused"),
    ("EXPLAIN ANALYZE SELECT * FROM read_text('{prefect}')", "refused"),
    ("WITH x AS (SELECT * FROM read_blob('{lock}')) SELECT * FROM x", "refused"),
    ("SUMMARIZE SELECT * FROM read_blob('{catalog}')", "refused"),
    ("DESCRIBE SELECT * FROM read_parquet('{out}/*.parquet')", "refused"),
    ("PIVOT (SELECT * FROM read_text('{record}')) ON filename USING count(*)", "refused"),
    ("SELECT * FROM read_text('http://127.0.0.1:9/x')", "refused"),
    ("SELECT * FROM 's3://bucket/x.parquet'", "refused"),
]


@pytest.mark.parametrize("attack,needle", ATTACKS, ids=[f"{i:02d}" for i in range(len(ATTACKS))])
def test_attack_is_refused_and_no_byte_changes(world, attack, needle):
    base, store, names = world
    before = _tree(base)
    with pytest.raises(QueryError, match=needle.replace("(", r"\(").replace(")", r"\)")) as info:
        sql(store, attack.format(**names))
    assert "\n" not in str(info.value)
    assert _tree(base) == before
    assert sql(store, "SELECT count(*) AS n, min(answer) AS a FROM prompts").to_pylist() == [{"n": 5, "a": "0"}]


def test_there_are_at_least_50_attacks_and_the_classic_one_is_refused_before_running():
    assert len(ATTACKS) >= 50
    with pytest.raises(QueryRefused, match="EXPLAIN COPY"):
        check_read_only(ATTACKS[0][0].format(part="/x.parquet"))


RAW_ATTACKS = [  # no filter in front: the connection alone must refuse these
    "EXPLAIN ANALYZE COPY (SELECT * REPLACE ('X' AS answer) FROM prompts) TO '{part}' (FORMAT parquet)",
    "EXPLAIN ANALYZE COPY (SELECT 'junk' AS x) TO '{record}' (FORMAT csv, HEADER false)",
    "COPY (SELECT 1 AS x) TO '{catalog}' (FORMAT parquet)",
    "COPY (SELECT 1 AS x) TO '{out}/x.csv'",
    "EXPORT DATABASE '{out}/dump'",
    "ATTACH '{catalog}' AS c",
    "ATTACH '{out}/new.duckdb' AS n",
    "SELECT * FROM read_text('{prefect}')",
    "SELECT * FROM read_blob('{lock}')",
    "SELECT * FROM read_json('{tmp}')",
    "SELECT * FROM read_json('{record}')",
    "SELECT * FROM read_parquet('{part}')",
    "SELECT * FROM '{out}/secret.csv'",
    "SELECT * FROM query('SELECT * FROM read_text(''{prefect}'')')",
    "SET enable_external_access = true",
    "SET disabled_filesystems = ''",
    "SET temp_directory = '{out}'",
    "SET lock_configuration = false",
    "SELECT * FROM enable_logging(storage = 'file', storage_path = '{out}/log')",
    "INSTALL httpfs",
    "LOAD sqlite",
]


@pytest.mark.parametrize("attack", RAW_ATTACKS, ids=[f"raw{i:02d}" for i in range(len(RAW_ATTACKS))])
def test_connection_alone_refuses_files_and_settings(world, attack):
    base, store, names = world
    before = _tree(base)
    con = confined_connection(store)
    try:
        with pytest.raises(duckdb.Error):
            con.execute(attack.format(**names))
    finally:
        con.close()
    assert _tree(base) == before


def test_connection_spills_nowhere_and_reads_through_views(world):
    _, store, _ = world
    con = confined_connection(store)
    try:
        settings = dict(con.execute("SELECT name, value FROM duckdb_settings()").fetchall())
        assert settings["temp_directory"] == "" and settings["enable_external_access"] == "false"
        assert settings["lock_configuration"] == "true"
        # (duckdb_settings shows disabled_filesystems empty in DuckDB 2.0.1; its effect is what counts)
        with pytest.raises(duckdb.PermissionException, match="LocalFileSystem has been disabled"):
            con.execute(f"SELECT * FROM read_parquet('{store.files('prompts')[0]}')")
        assert con.execute("SELECT count(*) FROM prompts").fetchone() == (5,)
    finally:
        con.close()


ALLOWED = [
    ("SELECT count(*) AS n FROM prompts", 1),
    ("WITH x AS (SELECT source, count(*) AS n FROM prompts GROUP BY 1) SELECT * FROM x", 1),
    ("FROM prompts", 5),
    ("FROM prompts SELECT answer WHERE answer > '4'", 2),
    ("TABLE pool", 5),
    ("VALUES (1, 'a'), (2, 'b')", 2),
    ("PIVOT prompts ON answer USING count(*) GROUP BY source", 1),
    ("PIVOT prompts ON answer IN ('0', '2') USING count(*) GROUP BY source", 1),
    ("SELECT * FROM (PIVOT pool ON status USING count(*) GROUP BY run_id)", 1),
    ("UNPIVOT (SELECT prompt_id, text, answer FROM prompts) ON text, answer INTO NAME k VALUE v", 10),
    ("SUMMARIZE prompts", 14),
    ("DESCRIBE prompts", 14),
    ("SHOW prompts", 14),
    ("SHOW TABLES", None),
    ("EXPLAIN SELECT * FROM prompts", 1),
    ("EXPLAIN ANALYZE SELECT count(*) FROM pool", 1),
    ("EXPLAIN (FORMAT json) SELECT 1", 1),
    ("EXPLAIN PIVOT prompts ON answer USING count(*)", 1),
    ("SELECT p.prompt_id, q.status FROM prompts p JOIN pool q USING (prompt_id) ORDER BY 1", 5),
    ("SELECT * FROM range(3)", 3),
    ("SELECT view_name FROM duckdb_views() WHERE NOT internal", None),
    ("select 1 as query", 1),  # a column named like a refused function is fine
]


@pytest.mark.parametrize("query,rows", ALLOWED, ids=[q for q, _ in ALLOWED])
def test_every_read_form_works(world, query, rows):
    _, store, _ = world
    t = sql(store, query)
    assert t.num_rows == rows if rows is not None else t.num_rows >= 1


def test_pivot_counts_are_right(world):
    _, store, _ = world
    t = sql(store, "PIVOT pool ON status USING count(*) GROUP BY run_id")
    assert t.to_pylist() == [{"run_id": "r", "active": 5}]


ERRORS = [
    ("SELECT anwser FROM prompts", 'Did you mean "answer"|Candidate bindings: "answer"'),
    ("SELECT * FROM promts", 'Did you mean "prompts"'),
    ("SELECT no_such_function(1)", "no_such_function does not exist"),
    ("SELECT 1 + 'a'", "explicit type casts"),
    ("SELECT CAST('x' AS INTEGER)", "Could not convert string 'x'"),
    ("SELEC nonsense", "SQL syntax error"),
    ("SELECT (", "SQL syntax error"),
    ("", "empty query"),
]


@pytest.mark.parametrize("query,needle", ERRORS, ids=[q or "empty" for q, _ in ERRORS])
def test_errors_are_one_line_naming_the_problem(world, query, needle):
    _, store, _ = world
    with pytest.raises(QueryError, match=needle) as info:
        sql(store, query)
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value) and "LINE 1" not in str(info.value)


def test_files_that_predate_a_column_read_with_nulls(tmp_path):
    store = Store(tmp_path / "s")
    store.commit("old", {"prompts": prompt_rows(3)})
    part = store.files("prompts")[0]
    pq.write_table(pq.read_table(part).drop(["external_id", "meta"]), part)  # as written before those columns
    store.commit("new", {"prompts": prompt_rows(2, offset=3)})
    t = sql(store, "SELECT count(*) AS n, count(external_id) AS ids, count(meta) AS metas FROM prompts")
    assert t.to_pylist() == [{"n": 5, "ids": 0, "metas": 0}]


def test_remote_store_reads_and_refuses(tmp_path):
    m = Store("memory://refinery-sql-confinement")
    m.commit("a", {"prompts": prompt_rows(4)})
    assert sql(m, "SELECT count(*) AS n FROM prompts").to_pylist() == [{"n": 4}]
    with pytest.raises(QueryRefused, match="EXPLAIN COPY"):
        sql(m, f"EXPLAIN ANALYZE COPY prompts TO '{tmp_path}/x.parquet'")
    with pytest.raises(QueryRefused, match="refused"):
        sql(m, "SELECT * FROM read_text('memory://refinery-sql-confinement/_landed/run_id=_ingest/round=_/a.json')")
    assert not (tmp_path / "x.parquet").exists()
