"""Hypothesis properties of the ingestion validator and of the store round trip."""

import datetime as dt
import json

import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage.ids import normalise_text, prompt_id
from storage.query import scan, sql
from storage.schemas import conform
from storage.store import Store
from tasks.sources import Limits, validate_record, validate_records

LIMITS = Limits(question=200, answer=50, solution=300, meta=500)
json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30)
values = st.recursive(json_scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                      max_leaves=6)
records = st.dictionaries(st.sampled_from(["question", "answer", "solution", "id", "meta", "other"]), values)
good_text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=60).filter(str.strip)


@given(records)
@settings(max_examples=400, deadline=None)
def test_validator_accepts_exactly_the_well_formed(rec):
    """Either a row comes back that is faithful to the record, or a ValueError names a field."""
    try:
        row = validate_record(rec, "src", LIMITS)
    except ValueError as e:
        assert "field '" in str(e) or "expected a JSON object" in str(e)
        return
    assert isinstance(rec["question"], str) and rec["question"].strip() and len(rec["question"]) <= LIMITS.question
    assert not isinstance(rec["answer"], bool) and str(rec["answer"]).strip()
    assert row.text == rec["question"] and row.answer == str(rec["answer"]).strip()
    assert row.prompt_id == prompt_id(rec["question"], str(rec["answer"]), "src")
    assert row.meta is None or json.loads(row.meta) == rec["meta"]
    assert row.solution == rec.get("solution")


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
