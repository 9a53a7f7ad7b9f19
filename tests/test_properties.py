"""Hypothesis properties of the ingestion validator and of the store round trip."""

import datetime as dt
import json
import math

import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage.query import scan, sql
from storage.schemas import conform
from storage.store import Store
from tasks.core.ids import normalise_text, prompt_id
from tasks.core.sources import Limits, validate_record, validate_records

LIMITS = Limits(question=200, answer=50, solution=300, meta=500)
json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30)
values = st.recursive(json_scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                      max_leaves=6)
good_text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=60).filter(str.strip)


def _finite(v) -> bool:
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, dict | list):
        return all(map(_finite, v.values() if isinstance(v, dict) else v))
    return True


def _storable_text(v, bound: int) -> bool:
    if not isinstance(v, str) or not v.strip() or len(v) > bound:
        return False
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def bad_fields(rec: dict) -> set[str]:
    """The fields of `rec` that the validator must refuse, by the documented rules (an independent oracle):
    question a non-empty string within its bound; answer such a string or a finite non-bool number; solution
    absent or such a string; id absent, a string or a non-bool integer; meta absent, or an object (or its JSON
    text) of finite values that fits its bound as JSON."""
    bad = set()
    if not _storable_text(rec.get("question"), LIMITS.question):
        bad.add("question")
    a = rec.get("answer")
    if isinstance(a, bool) or not (isinstance(a, str) or (isinstance(a, int | float) and _finite(a))) \
            or not _storable_text(str(a), LIMITS.answer):
        bad.add("answer")
    if rec.get("solution") is not None and not _storable_text(rec["solution"], LIMITS.solution):
        bad.add("solution")
    ext = rec.get("id")
    if ext is not None and (isinstance(ext, bool) or not isinstance(ext, str | int)):
        bad.add("id")
    meta = rec.get("meta")
    if isinstance(meta, str):
        try:
            meta = json.loads(meta)
        except ValueError:
            meta = ["not json"]
    if meta is not None:
        try:
            ok = isinstance(meta, dict) and _finite(meta) and len(
                json.dumps(meta, ensure_ascii=False, sort_keys=True).encode("utf-8").decode("utf-8")) <= LIMITS.meta
        except UnicodeEncodeError:
            ok = False
        if not ok:
            bad.add("meta")
    return bad


json_objects = st.dictionaries(st.text(max_size=5), values, max_size=3)
FIELDS = {  # per field: (well-formed values, malformed ones of every kind the validator must name)
    "question": (good_text, st.sampled_from(["", "  \t", "q" * 201, "lone \ud800 surrogate"]) | st.integers()
                 | st.none() | st.lists(st.text(max_size=3), max_size=2)),
    "answer": (good_text.filter(lambda t: len(t.strip()) <= 50) | st.integers(-10**6, 10**6)
               | st.floats(allow_nan=False, allow_infinity=False),
               st.sampled_from([True, "", " ", "a" * 51, 10**60, float("nan"), float("inf"), None, {"a": 1}])),
    "solution": (st.none() | st.text(max_size=40).filter(str.strip), st.sampled_from(["", "s" * 301, 7, float("nan")])),
    "id": (st.text(max_size=5) | st.integers(), st.sampled_from([True, 1.5, ["a"], float("nan")])),
    "meta": (json_objects | json_objects.map(json.dumps),
             st.sampled_from([[1], "not json", "[1, 2]", 3, {"x": float("nan")}, {"k": "v" * 600}])),
}

def _mostly(good, bad):
    """Well-formed three times in four, so both outcomes are common (one_of would weigh every branch)."""
    return st.sampled_from([True, True, True, False]).flatmap(lambda ok: good if ok else bad)


field = {k: _mostly(good, bad) for k, (good, bad) in FIELDS.items()}
records = _mostly(st.fixed_dictionaries({"question": field["question"], "answer": field["answer"]},
                                        optional={k: field[k] for k in ("solution", "id", "meta")} | {"other": values}),
                  st.fixed_dictionaries({}, optional=field))  # question or answer missing too


@given(records | st.lists(st.integers(), max_size=2) | st.text(max_size=5))
@settings(max_examples=400, deadline=None)
def test_validator_accepts_exactly_the_well_formed(rec):
    """A record is accepted iff the oracle finds no bad field, and then the row is faithful to it; a refused
    record's error names one of its bad fields."""
    bad = {"<record>"} if not isinstance(rec, dict) else bad_fields(rec)
    try:
        row = validate_record(rec, "src", LIMITS)
    except ValueError as e:
        assert bad, f"refused a well-formed record {rec!r}: {e}"
        if not isinstance(rec, dict):
            assert "expected a JSON object" in str(e)
        else:
            assert any(f"field {name!r}" in str(e) for name in bad), (bad, str(e))
        return
    assert not bad, f"accepted {rec!r}, whose {sorted(bad)} are malformed"
    answer = str(rec["answer"]).strip()
    assert row.text == rec["question"] and row.answer == answer
    assert row.prompt_id == prompt_id(rec["question"], answer, "src")
    meta = json.loads(rec["meta"]) if isinstance(rec.get("meta"), str) else rec.get("meta")
    assert (row.meta is None) == (meta is None) and (meta is None or json.loads(row.meta) == meta)
    assert row.solution == rec.get("solution")
    assert row.external_id == (None if rec.get("id") is None else str(rec["id"]))


@given(st.lists(st.tuples(good_text, st.integers(-1000, 1000), st.sampled_from(["x", "y", None])), max_size=25))
@settings(max_examples=150, deadline=None)
def test_validator_reports_each_conflicting_id_once(rows):
    recs = [(i + 1, {"question": q, "answer": a, **({"id": k} if k else {})}) for i, (q, a, k) in enumerate(rows)]
    good, bad = validate_records(recs, "f.jsonl", "src", LIMITS)
    assert len(good) + len(bad) == len(recs)
    first = {}
    for _line, rec in recs:
        if "id" in rec:
            first.setdefault(rec["id"], prompt_id(rec["question"], str(rec["answer"]), "src"))
    for r in good:
        if r.external_id:
            assert r.prompt_id == first[r.external_id]
    assert all("with different content" in b.problem for b in bad)


@given(good_text, good_text)
def test_prompt_id_ignores_whitespace_layout_only(text, answer):
    assert prompt_id(text, answer, "s") == prompt_id("  " + text.replace(" ", "\n ") + "\t", answer, "s")
    assert prompt_id(text, answer, "s") != prompt_id(text, answer, "t")
    assert normalise_text(normalise_text(text)) == normalise_text(text)


prompt_tables = st.lists(
    st.tuples(good_text, good_text, st.none() | st.text(max_size=40), st.none() | st.integers(0, 9)),
    min_size=1, max_size=30,
)


@given(prompt_tables)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_store_round_trip(tmp_path_factory, rows):
    store = Store(tmp_path_factory.mktemp("rt"))
    ids = [f"p{i}" for i in range(len(rows))]
    t = conform("prompts", pa.table({
        "prompt_id": ids, "text": [r[0] for r in rows], "answer": [r[1] for r in rows],
        "solution": [r[2] for r in rows], "source": ["s"] * len(rows), "root_id": ids,
        "transform": ["original"] * len(rows), "round": pa.array([r[3] for r in rows], pa.int32()),
        "created_at": [dt.datetime(2026, 5, 1, 12, tzinfo=dt.UTC)] * len(rows),
    }))
    store.commit("one", {"prompts": t}, run_id="r", round=0)
    back_pl = scan(store, "prompts").collect().to_arrow().cast(t.schema)
    back_sql = sql(store, "SELECT * FROM prompts ORDER BY prompt_id").cast(t.schema)
    key = lambda tab: sorted(tab.to_pylist(), key=lambda r: r["prompt_id"])  # noqa: E731
    assert key(back_pl) == key(t) == key(back_sql)
