"""`refinery sql` prints every DuckDB type in every format, never crashes on its output, and bounds what one
query may cost: a row cap on the table, a timeout, DuckDB's memory and threads (flows/sql_output.py,
storage/query.py `query_batches`, `sql_limits`)."""

import io
import json
import subprocess

import pytest
from test_cli_errors import REFINERY, assert_one_line_error, refinery

from flows.sql_output import unique_names, write_result
from storage.query import query_batches
from storage.store import Store
from tasks.ingest import ingest_source

# (query, rows): DuckDB's types that Python, polars or JSON cannot take as they are, and ordinary ones
TYPES = {
    "interval": ("SELECT max(created_at) - min(created_at) AS span, INTERVAL 3 DAY + INTERVAL 2 HOUR AS i "
                 "FROM prompts", 1),
    "union": ("SELECT union_value(k := 1) AS u", 1),
    "duplicate names": ("SELECT a.prompt_id, b.prompt_id FROM prompts a JOIN prompts b USING (prompt_id)", 4),
    "infinite timestamps": ("SELECT 'infinity'::TIMESTAMP AS t, '-infinity'::TIMESTAMPTZ AS tz, "
                            "'294247-01-10 04:00:54'::TIMESTAMP AS far", 1),
    "infinite date": ("SELECT 'infinity'::DATE AS d, '5877642-06-25 (BC)'::DATE AS bc", 1),
    "huge integers": ("SELECT 170141183460469231731687303715884105727::HUGEINT AS h, "
                      "340282366920938463463374607431768211455::UHUGEINT AS u, sum(length(text)) AS s, "
                      "123456789012345678901234567890::VARINT AS v FROM prompts", 1),
    "decimal": ("SELECT 1234567890123456789012345678.1234567890::DECIMAL(38,10) AS d", 1),
    "blob": ("SELECT '\\xFF\\x00\\xC3'::BLOB AS b, '0101'::BIT AS bits", 1),
    "nested": ("SELECT [1, 2] AS l, {'a': 1, 'b': [1.5, 'nan'::DOUBLE]} AS s, MAP {'k': 1} AS m, "
               "[INTERVAL 1 DAY] AS li, {'d': 'infinity'::DATE} AS sd, [1, 2, 3]::INTEGER[3] AS arr", 1),
    "enum uuid": ("SELECT 'x'::ENUM('x', 'y') AS e, gen_random_uuid() AS u", 1),
    "times": ("SELECT '12:34:56'::TIME AS t, '12:34:56+02'::TIMETZ AS tz, now() AS n, "
              "'2020-01-01'::TIMESTAMP_S AS s", 1),
    "null column": ("SELECT NULL AS n, NULL::INTEGER AS i", 1),
    "no rows": ("SELECT * FROM prompts WHERE false", 0),
    "non-finite floats": ("SELECT 'nan'::DOUBLE AS x, 'inf'::DOUBLE AS y, -1e308 * 10 AS z, 'nan'::FLOAT AS f", 1),
    "wide text": ("SELECT repeat('x', 10000) AS w, 'two\nlines' AS t", 1),
    "explain": ("EXPLAIN SELECT count(*) FROM prompts", 1),
    "ordinary": ("SELECT prompt_id, text, answer, created_at FROM prompts", 4),
}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Store:
    store = Store(tmp_path_factory.mktemp("sql-output") / "store")
    ingest_source(store, "rg:products", size=4, seed=0, params={"max_digits": 1})
    return store


def _strict_json(text: str):
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))


def _print(store, query: str, fmt: str, limit: int | None = None) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    with query_batches(store, query) as result:
        write_result(result, fmt, limit, out, err)
    return out.getvalue(), err.getvalue()


@pytest.mark.parametrize("name", list(TYPES))
def test_every_type_prints_in_every_format(store, name):
    query, n = TYPES[name]
    table, _ = _print(store, query, "table")
    assert table.rstrip().endswith(f"({n} rows)")
    rows = _strict_json(_print(store, query, "json")[0])
    assert isinstance(rows, list) and len(rows) == n
    csv_text, _ = _print(store, query, "csv")
    assert len(list(__import__("csv").reader(io.StringIO(csv_text)))) == n + 1  # the header, then the rows


def test_json_values_where_json_has_them_and_duckdb_text_elsewhere(store):
    row = _strict_json(_print(store, TYPES["non-finite floats"][0] + ", 1.5::DOUBLE AS ok", "json")[0])[0]
    assert row == {"x": None, "y": None, "z": None, "f": None, "ok": 1.5}
    row = _strict_json(_print(store, TYPES["huge integers"][0], "json")[0])[0]
    assert row["h"] == 2**127 - 1 and row["u"] == 2**128 - 1 and isinstance(row["s"], int)
    row = _strict_json(_print(store, TYPES["nested"][0], "json")[0])[0]
    assert row["l"] == [1, 2] and row["s"] == {"a": 1, "b": [1.5, None]} and row["li"] == "[1 day]"
    assert row["sd"] == "{'d': infinity}" and row["arr"] == [1, 2, 3]
    row = _strict_json(_print(store, TYPES["infinite timestamps"][0], "json")[0])[0]
    assert row["t"] == "infinity" and row["tz"] == "-infinity"
    assert list(_strict_json(_print(store, TYPES["duplicate names"][0], "json")[0])[0]) == ["prompt_id", "prompt_id_1"]
    assert unique_names(["x", "x", "x_1", "x"]) == ["x", "x_2", "x_1", "x_3"]


def test_the_table_shows_at_most_its_cap_and_says_how_many_more(store):
    out, _ = _print(store, "SELECT * FROM range(2500)", "table")
    assert out.count("\n│ ") == 1000 + 3  # the header's three lines, then 1000 rows
    assert out.endswith("(2500 rows, the first 1000 shown)\n1500 more rows: use --limit or --format csv\n")
    out, _ = _print(store, "SELECT * FROM range(2500)", "table", limit=0)
    assert out.endswith("(2500 rows)\n")
    out, err = _print(store, "SELECT * FROM range(2500)", "csv")
    assert out.count("\n") == 2501 and err == ""
    out, err = _print(store, "SELECT * FROM range(2500)", "json", limit=10)
    assert len(_strict_json(out)) == 10 and err == "2490 more rows: use --limit 0 for all\n"


# ---- through the command, as a terminal shows it ---------------------------------------------------------

@pytest.mark.parametrize("query", [
    "SELECT 'infinity'::TIMESTAMP",                         # polars panicked: a 20-line Rust traceback
    "SELECT max(created_at) - min(created_at) FROM prompts",  # an interval: the bug hint
    "SELECT union_value(k := 1)",
    "SELECT a.prompt_id, b.prompt_id FROM prompts a JOIN prompts b USING (prompt_id)",
], ids=["infinite-timestamp", "interval", "union", "duplicate-names"])
def test_queries_that_crashed_the_table_print(store, tmp_path, query):
    p = refinery("sql", query, "--store", store.root, cwd=tmp_path)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert p.stdout.rstrip().endswith("rows)")


def test_json_of_non_finite_rewards_is_valid(store, tmp_path):
    p = refinery("sql", "SELECT 1e308 * 10 AS r, -1e308 * 10 AS s, 'nan'::DOUBLE AS n", "--format", "json",
                 "--store", store.root, cwd=tmp_path)
    assert p.returncode == 0 and _strict_json(p.stdout) == [{"r": None, "s": None, "n": None}]


def test_a_long_query_stops_at_its_timeout(store, tmp_path):
    p = refinery("sql", "SELECT count(*) FROM range(300000) a, range(300000) b WHERE a.range + b.range = -1",
                 "--timeout", "1", "--store", store.root, cwd=tmp_path)
    assert_one_line_error(p, "query stopped after 1 s: raise --timeout")
    assert "bug" not in p.stderr


def test_duckdb_takes_a_share_of_the_machine_unless_told(store, tmp_path):
    query = "SELECT current_setting('memory_limit') AS m, current_setting('threads') AS t"
    p = refinery("sql", query, "--format", "json", "--store", store.root, cwd=tmp_path)
    import os

    import psutil

    got = _strict_json(p.stdout)[0]
    assert got["t"] == os.cpu_count()
    value, unit = got["m"].split()
    assert float(value) * {"GiB": 2**30, "MiB": 2**20}[unit] == pytest.approx(psutil.virtual_memory().total / 2,
                                                                               rel=0.02)
    p = refinery("sql", query, "--format", "json", "--store", store.root, cwd=tmp_path,
                 env={"REFINERY_SQL_MEMORY": "300MB", "REFINERY_SQL_THREADS": "1"})
    assert _strict_json(p.stdout) == [{"m": "286.1 MiB", "t": 1}]
    p = refinery("sql", "SELECT list(range) FROM range(30000000)", "--store", store.root, cwd=tmp_path,
                 env={"REFINERY_SQL_MEMORY": "50MB"})
    assert_one_line_error(p, "Out of Memory Error", "REFINERY_SQL_MEMORY")
    p = refinery("sql", "SELECT 1", "--store", store.root, cwd=tmp_path, env={"REFINERY_SQL_MEMORY": "lots"})
    assert_one_line_error(p, "REFINERY_SQL_MEMORY='lots' is not a memory size")


def test_a_closed_pipe_ends_the_output_quietly(store, tmp_path):
    for fmt in ("table", "csv", "json"):
        p = subprocess.run(f"'{REFINERY}' sql 'SELECT * FROM range(200000)' --format {fmt} --store "
                           f"'{store.root}' | head -1", shell=True, capture_output=True, text=True, cwd=tmp_path)
        assert p.returncode == 0 and p.stderr == "", (fmt, p.stderr)
        assert p.stdout.count("\n") == 1
