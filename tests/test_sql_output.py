"""`refinery sql` prints every DuckDB type in every format, never crashes on its output, and bounds what one
query may cost: a row cap on the table, a timeout, DuckDB's memory and threads (flows/cli/sql_output.py,
storage/query.py `query_batches`, `sql_limits`)."""

import io
import json
import subprocess

import duckdb
import pytest
from test_cli_errors import REFINERY, assert_one_line_error, refinery

from flows.cli.sql_output import unique_names, write_result
from storage.query import machine_memory, query_batches
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
    row = _strict_json(_print(store, TYPES["blob"][0], "json")[0])[0]
    assert row == {"b": "\\xFF\\x00\\xC3", "bits": "0101"}  # bytes as DuckDB's \xHH text (module docstring)
    row = _strict_json(_print(store, TYPES["huge integers"][0], "json")[0])[0]
    assert row["v"] == "123456789012345678901234567890"  # a VARINT's digits are unbounded: its text
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

    got = _strict_json(p.stdout)[0]
    assert got["t"] == len(os.sched_getaffinity(0))  # the cores this process may run on
    value, unit = got["m"].split()
    assert float(value) * {"GiB": 2**30, "MiB": 2**20}[unit] == pytest.approx(machine_memory() / 2, rel=0.02)
    p = refinery("sql", query, "--format", "json", "--store", store.root, cwd=tmp_path,
                 env={"REFINERY_SQL_MEMORY": "300MB", "REFINERY_SQL_THREADS": "1"})
    assert _strict_json(p.stdout) == [{"m": "286.1 MiB", "t": 1}]
    p = refinery("sql", "SELECT list(range) FROM range(30000000)", "--store", store.root, cwd=tmp_path,
                 env={"REFINERY_SQL_MEMORY": "50MB"})
    assert_one_line_error(p, "Out of Memory Error", "REFINERY_SQL_MEMORY")
    p = refinery("sql", "SELECT 1", "--store", store.root, cwd=tmp_path, env={"REFINERY_SQL_MEMORY": "lots"})
    assert_one_line_error(p, "REFINERY_SQL_MEMORY='lots' is not a memory size")
    p = refinery("sql", "SELECT 1", "--store", store.root, cwd=tmp_path, env={"REFINERY_SQL_THREADS": "0"})
    assert_one_line_error(p, "REFINERY_SQL_THREADS='0': expected a whole number of threads, at least 1")


def test_a_closed_pipe_ends_the_output_quietly(store, tmp_path):
    for fmt in ("table", "csv", "json"):
        p = subprocess.run(f"'{REFINERY}' sql 'SELECT * FROM range(200000)' --format {fmt} --store "
                           f"'{store.root}' | head -1", shell=True, capture_output=True, text=True, cwd=tmp_path)
        assert p.returncode == 0 and p.stderr == "", (fmt, p.stderr)
        assert p.stdout.count("\n") == 1


def test_the_row_cap_through_the_command(store, tmp_path):
    p = refinery("sql", "SELECT range AS n FROM range(100000)", "--store", store.root, cwd=tmp_path)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert p.stdout.endswith("(100000 rows, the first 1000 shown)\n99000 more rows: use --limit or --format csv\n")
    assert len(p.stdout) < 100_000  # 1000 rows of text, not 100k
    p = refinery("sql", "SELECT range AS n FROM range(100000)", "--limit", "5", "--store", store.root, cwd=tmp_path)
    assert [ln.strip("│ ") for ln in p.stdout.splitlines()[5:10]] == ["0", "1", "2", "3", "4"]
    assert p.stdout.endswith("(100000 rows, the first 5 shown)\n99995 more rows: use --limit or --format csv\n")
    p = refinery("sql", "SELECT range AS n FROM range(2500)", "--limit", "0", "--store", store.root, cwd=tmp_path)
    assert p.stdout.count("\n│ ") == 2500 + 3 and p.stdout.endswith("(2500 rows)\n")  # the header's 3 lines
    for flag, value, needle in [("--limit", "-1", "--limit -1: a number of rows"),
                                ("--timeout", "-1", "--timeout -1: seconds")]:
        assert "bug" not in assert_one_line_error(refinery("sql", "SELECT 1", flag, value, "--store", store.root,
                                                           cwd=tmp_path), needle)


def test_writing_to_a_slow_reader_does_not_count_against_the_timeout(store, tmp_path):
    # 5 MB of CSV into a pipe whose reader waits 3 s: the writer blocks past --timeout 1, but DuckDB works
    # well under a second on it (before: "reading the store failed: INTERRUPT Error" after 10,000 rows)
    p = subprocess.run(f"'{REFINERY}' sql \"SELECT range, repeat('x', 100) AS t FROM range(50000)\" --format csv "
                       f"--timeout 1 --store '{store.root}' | (sleep 3; wc -l)", shell=True, capture_output=True,
                       text=True, cwd=tmp_path)
    assert p.returncode == 0 and p.stderr == "" and p.stdout.strip() == "50001", p.stderr


def test_an_error_while_rows_stream_is_duckdbs_own(store, tmp_path):
    # the cast fails in a later batch: DuckDB's error comes through Arrow's stream as an OSError
    p = refinery("sql", "SELECT CASE WHEN range > 50000 THEN 'x'::VARCHAR::INTEGER ELSE range END AS v "
                 "FROM range(100000)", "--format", "csv", "--store", store.root, cwd=tmp_path)
    line = assert_one_line_error(p, "Conversion Error: Could not convert string 'x'")
    assert "reading the store" not in line and "bug" not in p.stderr


def test_a_query_of_no_columns_is_one_line(store, tmp_path):
    # DuckDB allows no zero-column result: both ways of asking are its binder's one-line refusal
    for query in ["SELECT COLUMNS('nothing') FROM prompts", "SELECT * EXCLUDE (prompt_id) FROM (SELECT prompt_id "
                  "FROM prompts)"]:
        p = refinery("sql", query, "--store", store.root, cwd=tmp_path)
        assert "bug" not in assert_one_line_error(p, "Binder Error") + p.stderr


def test_a_container_limit_below_the_machine_halves_that(tmp_path):
    import psutil

    total = psutil.virtual_memory().total
    (v2 := tmp_path / "memory.max").write_text("max\n")
    (v1 := tmp_path / "limit_in_bytes").write_text(f"{2**63 - 4096}\n")
    assert machine_memory((str(v2), str(v1), str(tmp_path / "absent"))) == total
    v2.write_text(f"{2**30}\n")
    assert machine_memory((str(v2), str(v1))) == min(total, 2**30)


def _panic() -> BaseException:
    """A Rust panic as pyo3 raises it (a BaseException, not an Exception): polars printing an infinite
    timestamp, as `refinery sql`'s table once did; a stand-in of the same kind if polars has stopped panicking."""
    import polars as pl

    frame = pl.from_arrow(duckdb.sql("SELECT 'infinity'::TIMESTAMP AS t").to_arrow_table())
    try:
        str(frame)
    except BaseException as e:  # noqa: BLE001 - the point
        return e
    return type("PanicException", (BaseException,), {})("invalid or out-of-range datetime")


@pytest.mark.parametrize("raised, rc, lines", [
    (_panic, 1, ["refinery: error: PanicException: invalid or out-of-range datetime",
                 "hint: this looks like a bug: rerun with --debug (or REFINERY_DEBUG=1) for the traceback"]),
    (lambda: KeyboardInterrupt(), 130, ["refinery: error: interrupted"]),
], ids=["rust-panic", "ctrl-c"])
def test_main_turns_any_base_exception_into_one_line(store, monkeypatch, capsys, raised, rc, lines):
    import flows.cli.parser

    exc = raised()
    assert not isinstance(exc, Exception)  # what `except Exception` missed

    def cmd(a):
        raise exc

    monkeypatch.setattr(flows.cli.parser, "cmd_sql", cmd)
    assert flows.cli.parser.main(["sql", "SELECT 1", "--store", store.root]) == rc
    assert capsys.readouterr().err.splitlines() == lines


@pytest.mark.parametrize("exc", [SystemExit(3), GeneratorExit()])
def test_main_lets_exit_and_generator_exit_through(store, monkeypatch, exc):
    import flows.cli.parser

    def cmd(a):
        raise exc

    monkeypatch.setattr(flows.cli.parser, "cmd_sql", cmd)
    with pytest.raises(type(exc)):
        flows.cli.parser.main(["sql", "SELECT 1", "--store", store.root])
