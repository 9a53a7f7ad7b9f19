"""The SQL interface reads the store and nothing else: escapes are refused and the store is unchanged."""

import hashlib

import pytest
from conftest import prompt_rows

from storage.query import QueryRefused, sql


def _tree_digest(root):
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


ESCAPES = [
    ("COPY prompts TO '{out}/x.csv'", "COPY"),
    ("COPY (SELECT 1) TO '{store}/inside.csv'", "COPY"),
    ("SELECT * FROM read_csv('/etc/passwd')", "Cannot access file"),
    ("SELECT * FROM read_csv_auto('/etc/passwd')", "Cannot access file"),
    ("SELECT * FROM read_text('/etc/passwd')", "Cannot access file"),
    ("SELECT * FROM read_blob('/etc/hostname')", "Cannot access file"),
    ("SELECT * FROM read_csv('{store}/../../../etc/passwd')", "Cannot access file"),
    ("SELECT * FROM glob('/etc/*')", "Cannot access file"),
    ("ATTACH '{out}/evil.duckdb' AS evil", "ATTACH"),
    ("INSTALL httpfs", "INSTALL"),
    ("LOAD httpfs", "LOAD"),
    ("SET enable_external_access = true", "SET"),
    ("SET allowed_directories = ['/']", "SET"),
    ("RESET allowed_directories", "RESET"),
    ("PRAGMA enable_profiling", "PRAGMA"),
    ("CREATE TABLE t AS SELECT 1", "CREATE"),
    ("DROP VIEW prompts", "DROP"),
    ("DELETE FROM prompts", "DELETE"),
    ("INSERT INTO prompts SELECT * FROM prompts", "INSERT"),
    ("EXPORT DATABASE '{out}/dump'", "EXPORT"),
    ("SELECT 1; COPY prompts TO '{out}/y.csv'", "exactly one statement"),
    ("CALL pragma_version()", "CALL"),
]


@pytest.mark.parametrize("query,needle", ESCAPES, ids=[q for q, _ in ESCAPES])
def test_escape_is_refused_and_store_unchanged(store, tmp_path, query, needle):
    store.commit("a", {"prompts": prompt_rows(5)})
    out = tmp_path / "outside"
    out.mkdir()
    before = _tree_digest(tmp_path)
    with pytest.raises(QueryRefused, match=needle):
        sql(store, query.format(out=out, store=store.root))
    assert _tree_digest(tmp_path) == before
    assert sql(store, "SELECT count(*) AS n FROM prompts").to_pylist() == [{"n": 5}]


def test_reads_are_allowed(store):
    store.commit("a", {"prompts": prompt_rows(5)})
    t = sql(store, "WITH x AS (SELECT source, count(*) AS n FROM prompts GROUP BY 1) SELECT * FROM x")
    assert t.to_pylist() == [{"source": "test", "n": 5}]
    assert sql(store, "EXPLAIN SELECT * FROM prompts").num_rows >= 1


def test_syntax_errors_are_reported_plainly(store):
    with pytest.raises(QueryRefused, match="syntax error"):
        sql(store, "SELEC nonsense")
