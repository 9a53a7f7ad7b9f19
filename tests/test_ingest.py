import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flows.cli import main
from storage.query import sql
from tasks.core.sources import SourceError
from tasks.ingest import IngestRejected, ingest_source


def _counts(store):
    return {r["source"]: r["n"] for r in sql(store, "SELECT source, count(*) AS n FROM prompts GROUP BY 1").to_pylist()}


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_rg_and_jsonl_counts_and_reingest_is_a_noop(store, tmp_path):
    f = _jsonl(tmp_path / "thirty.jsonl", [{"question": f"What is {i} times 3?", "answer": 3 * i} for i in range(30)])
    s1 = ingest_source(store, "rg:products", size=50, seed=1)
    s2 = ingest_source(store, str(f))
    assert (s1.new, s2.new) == (50, 30)
    assert _counts(store) == {"rg:products": 50, "thirty.jsonl": 30}
    again = [ingest_source(store, "rg:products", size=50, seed=1), ingest_source(store, str(f))]
    assert [(s.new, s.already_present) for s in again] == [(0, 50), (0, 30)]
    assert _counts(store) == {"rg:products": 50, "thirty.jsonl": 30}


def test_rg_params_reach_the_generator(store):
    ingest_source(store, "rg:products", size=20, seed=3, params={"max_digits": "1"})
    rows = sql(store, "SELECT answer, params, meta FROM prompts").to_pylist()
    assert all(int(r["answer"]) <= 81 for r in rows)
    assert json.loads(rows[0]["params"])["max_digits"] == 1
    assert json.loads(rows[0]["meta"])["source_dataset"] == "products"


def test_rg_errors_name_the_problem(store):
    with pytest.raises(SourceError, match="unknown reasoning-gym task 'prodcts'"):
        ingest_source(store, "rg:prodcts", size=5)
    with pytest.raises(SourceError, match="rg:products has no parameter 'digits'"):
        ingest_source(store, "rg:products", size=5, params={"digits": "1"})
    with pytest.raises(SourceError, match="rejected parameters"):
        ingest_source(store, "rg:products", size=5, params={"min_digits": "3", "max_digits": "1"})


BAD_LINES = [
    (b'{"question": "fine", "answer": "1"}', None),
    (b'{"question": "no answer"}', "field 'answer' is missing"),
    (b'{"question": 5, "answer": "1"}', "field 'question' must be a string, got int"),
    (b'{"question": "  ", "answer": "1"}', "field 'question' is empty"),
    (b'{"question": "bad \xff byte", "answer": "1"}', "invalid UTF-8"),
    (b'{"question": "' + b"x" * 16_001 + b'", "answer": "1"}', "over the bound of 16,000"),
    (b'{"question": "a", "answer": "1", "id": "dup"}', None),
    (b'{"question": "b", "answer": "2", "id": "dup"}', "id 'dup' was used on line 7 with different content"),
    (b'{"question": "a", "answer": "1", "id": "dup"}', None),
    (b"[1, 2]", "expected a JSON object, got list"),
    (b"{not json", "not valid JSON"),
    (b'{"question": "m", "answer": true}', "field 'answer' must be a string or a number, got bool"),
    (b'{"question": "m", "answer": "1", "meta": [1]}', "field 'meta' must be an object"),
    (b'{"question": "\\ud800", "answer": "1"}', "lone surrogate"),
    # Python's json reads these non-standard tokens as floats, which were stored as the answer "nan"
    (b'{"question": "n", "answer": NaN}', "field 'answer' holds NaN, not a finite number"),
    (b'{"question": "i", "answer": Infinity}', "field 'answer' holds Infinity, not a finite number"),
    (b'{"question": "j", "answer": -Infinity}', "field 'answer' holds -Infinity, not a finite number"),
    (b'{"question": "k", "answer": "1", "meta": {"w": [1, NaN]}}', "field 'meta' holds NaN, not a finite number"),
]


def test_bad_file_is_rejected_whole_with_every_line_named(store, tmp_path):
    store_before = _counts(store)
    f = tmp_path / "bad.jsonl"
    f.write_bytes(b"\n".join(line for line, _ in BAD_LINES) + b"\n")
    with pytest.raises(IngestRejected) as e:
        ingest_source(store, str(f))
    expected = [(i, why) for i, (_, why) in enumerate(BAD_LINES, start=1) if why]
    assert [(b.line, b.file) for b in e.value.bad] == [(i, "bad.jsonl") for i, _ in expected]
    for bad, (_, why) in zip(e.value.bad, expected):
        assert why in bad.problem
    assert _counts(store) == store_before == {}
    assert store.records() == []


def test_skip_invalid_lands_the_good_rows(store, tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_bytes(b"\n".join(line for line, _ in BAD_LINES) + b"\n")
    s = ingest_source(store, str(f), skip_invalid=True)
    assert s.new == 2 and len(s.skipped) == 15 and s.duplicates_in_source == 1
    assert _counts(store) == {"bad.jsonl": 2}


def test_parquet_source(store, tmp_path):
    t = pa.table({"question": ["q1", "q2", None], "answer": ["1", "2", "3"], "solution": ["s", None, None],
                  "id": ["a", "b", "c"], "meta": [json.dumps({"x": 1}), None, None]})
    pq.write_table(t, tmp_path / "p.parquet")
    with pytest.raises(IngestRejected, match="p.parquet line 3: field 'question' is missing"):
        ingest_source(store, str(tmp_path / "p.parquet"))
    s = ingest_source(store, str(tmp_path / "p.parquet"), skip_invalid=True, source_name="mine")
    assert s.new == 2
    rows = sql(store, "SELECT text, solution, external_id, source, meta FROM prompts ORDER BY text").to_pylist()
    assert rows == [{"text": "q1", "solution": "s", "external_id": "a", "source": "mine", "meta": '{"x": 1}'},
                    {"text": "q2", "solution": None, "external_id": "b", "source": "mine", "meta": None}]
    pq.write_table(pa.table({"question": ["q", "r", "s", "t"], "answer": [1.5, float("nan"), float("-inf"), 2.0],
                             "meta": ['{"x": 1}', None, None, '{"x": NaN}']}), tmp_path / "floats.parquet")
    with pytest.raises(IngestRejected) as e:
        ingest_source(store, str(tmp_path / "floats.parquet"))
    assert [str(b) for b in e.value.bad][:2] == [
        "floats.parquet line 2: field 'answer' holds NaN, not a finite number",
        "floats.parquet line 3: field 'answer' holds -Infinity, not a finite number"]
    assert str(e.value.bad[2]).startswith("floats.parquet line 4: field 'meta' cannot be stored as JSON: Out of range")
    pq.write_table(pa.table({"question": ["q"]}), tmp_path / "noanswer.parquet")
    with pytest.raises(IngestRejected, match="column\\(s\\) missing: answer"):
        ingest_source(store, str(tmp_path / "noanswer.parquet"))


def test_cli_ingest_sql_and_rejection_through_prefect(prefect_api, store, tmp_path, capsys):
    f = _jsonl(tmp_path / "thirty.jsonl", [{"question": f"q{i}", "answer": i} for i in range(30)])
    assert main(["ingest", "rg:products", "--size", "50", "--seed", "1", "--store", store.root]) == 0
    assert main(["ingest", str(f), "--store", store.root]) == 0
    capsys.readouterr()
    assert main(["sql", "select source, count(*) as n from prompts group by 1 order by 1", "--format", "json",
                 "--store", store.root]) == 0
    assert json.loads(capsys.readouterr().out) == [{"source": "rg:products", "n": 50}, {"source": "thirty.jsonl", "n": 30}]
    assert main(["sql", "select count(*) as n from prompts", "--format", "csv", "--store", store.root]) == 0
    assert capsys.readouterr().out.split() == ["n", "80"]

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"question": "ok", "answer": 1}\n{"question": "x"}\n{"answer": 2}\n')
    assert main(["ingest", str(bad), "--store", store.root]) == 1
    err = capsys.readouterr().err
    assert "bad.jsonl line 2: field 'answer' is missing" in err and "bad.jsonl line 3: field 'question' is missing" in err
    assert main(["sql", "COPY prompts TO 'x.csv'", "--store", store.root]) == 1
    assert "read-only" in capsys.readouterr().err
    assert _counts(store) == {"rg:products": 50, "thirty.jsonl": 30}
