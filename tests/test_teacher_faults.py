"""Teacher faults are survived, not fatal: answers land as they return, a failed prompt falls back with its
reason recorded and is asked again later, and a run whose teacher endpoint is down completes, then resumes
with a working teacher (a changed config field that is allowed and recorded) without asking anything twice.
Every teacher here is a real HTTP server on 127.0.0.1 (tests/test_openai_http.py's TeacherServer)."""

import contextlib
import io
import json
import threading
import time

import pytest
from conftest import round_ctx
from test_curriculum import TINY
from test_openai_http import CHAT_PATH, TeacherServer, closed_port
from test_refine_stage import _original, _seed_round

import tasks.refine
import tasks.strategies.teacher_calls
from flows.cli import print_summary
from flows.config import RefineConfig, load_config
from models.registry import load_teacher
from storage.query import scan, sql
from tasks.refine import refine
from tasks.strategies.teacher_calls import TeacherConfig, ask_teacher, teacher_cache

FAST = dict(retries=1, backoff_s=0.01, timeout_s=5.0)  # [teacher]: a down endpoint fails fast


def _openai(url: str) -> str:
    return f"openai:{url}#teacher"


def _landed_keys(store) -> list[str]:
    return scan(store, "teacher_calls").collect()["key"].to_list()


def test_answers_land_as_they_return_and_failures_are_asked_again(store, monkeypatch):
    """A slow question does not hold back the answers that already returned; a question answered with
    garbage is not cached, and the next ask sends exactly that one again."""
    monkeypatch.setattr(tasks.strategies.teacher_calls, "LAND_EVERY_S", 0.0)  # land each answer as it comes, to observe it
    release, fixed = threading.Event(), threading.Event()

    def script(srv, path, body):
        question = body["messages"][-1]["content"]
        if "SLOW" in question:
            release.wait(30)
        if "BAD" in question and not fixed.is_set():
            return 200, b"<html>upstream error</html>", {}
        return None

    # k0 goes first and finds the chat endpoint alone (the probe), then k1..k4 go 3 at a time
    payloads = {f"k{i}": f"Problem:\nQuestion {i}{' SLOW' * (i == 3)}{' BAD' * (i == 4)}\n\nCorrect answer: {i}"
                for i in range(5)}
    with TeacherServer(script=script) as srv:
        teacher = load_teacher(_openai(srv.url), None, TeacherConfig(**FAST, concurrency=3))
        cache: dict = {}
        result: list = []
        asking = threading.Thread(target=lambda: result.append(ask_teacher(store, teacher, payloads, cache, 16)))
        asking.start()
        deadline = time.time() + 20
        while len(_landed_keys(store)) < 3:  # k0..k2 answered, k4 garbage, k3 still held by the server
            assert time.time() < deadline, "the fast answers did not land while a slow one was pending"
            time.sleep(0.05)
        assert srv.in_flight == 1 and sorted(_landed_keys(store)) == ["k0", "k1", "k2"]
        release.set()
        asking.join(20)
        fresh, failed = result[0]
        assert fresh == {"k0", "k1", "k2", "k3"} and list(failed) == ["k4"]
        assert failed["k4"] == f"{srv.url}{CHAT_PATH} answered HTTP 200 with a body that is not JSON: " \
                               "'<html>upstream error</html>'"
        assert sorted(_landed_keys(store)) == ["k0", "k1", "k2", "k3"] and srv.count() == 5
        # the next ask (a later stage or run) reads the landed answers and sends only the failed question
        fixed.set()
        fresh, failed = ask_teacher(store, teacher, payloads, teacher_cache(store), 16)
        assert fresh == {"k4"} and not failed and srv.count() == 6
        assert srv.asked()[payloads["k4"]] == 2 and max(srv.asked()[payloads[k]] for k in ("k0", "k1", "k2", "k3")) == 1


def test_local_teacher_lands_batch_by_batch(store, tiny_backend):
    """The local-model teacher answers in generate calls of its batch size, each landing when it returns."""

    class Counting:
        name, batch_size = "tiny-teacher", 2

        def __init__(self):
            self.batches = []

        def render(self, messages):
            return tiny_backend.render(messages)

        def generate(self, prompts, n, sampling, progress=None, row_seeds=None):
            self.batches.append((len(prompts), len(_landed_keys(store))))  # (asked, landed before this call)
            return tiny_backend.generate(prompts, n, sampling, row_seeds=row_seeds)

    teacher = Counting()
    fresh, failed = ask_teacher(store, teacher, {f"k{i}": f"Say {i}." for i in range(5)}, {}, 4)
    assert teacher.batches == [(2, 0), (2, 2), (1, 4)] and len(fresh) == 5 and not failed
    assert sorted(_landed_keys(store)) == [f"k{i}" for i in range(5)]
    # one commit per batch, however long the generate call took: a split by timing made the landed-stage list
    # of a resumed run differ from an uninterrupted one's (the SIGKILL fault tests compare them)
    assert sum(r["stage"].startswith("teacher-") for r in store.records()) == 3


def test_a_slow_local_batch_still_lands_as_one_commit(store, tiny_backend, monkeypatch):
    monkeypatch.setattr(tasks.strategies.teacher_calls, "LAND_EVERY_S", 0.0)  # every answer is "late"

    class Teacher:
        name, batch_size = "tiny-teacher", 3

        def render(self, messages):
            return tiny_backend.render(messages)

        def generate(self, prompts, n, sampling, progress=None, row_seeds=None):
            return tiny_backend.generate(prompts, n, sampling, row_seeds=row_seeds)

    fresh, _ = ask_teacher(store, Teacher(), {f"k{i}": f"Say {i}." for i in range(6)}, {}, 4)
    assert len(fresh) == 6 and sum(r["stage"].startswith("teacher-") for r in store.records()) == 2


def test_refine_stage_falls_back_per_prompt_when_the_teacher_is_down(store):
    prompts = [_original(f"Solve the following multiplication: {a} * {b}.", str(a * b)) for a, b in ((7, 8), (6, 9))]
    _seed_round(store, "a", prompts, {0: [0] * 4, 1: [0] * 4})
    cfg, asking = RefineConfig(strategies=["ladder", "teacher_scaffold"]), TeacherConfig(**FAST)
    url = f"http://127.0.0.1:{closed_port()}"
    t0 = time.perf_counter()
    out = refine(round_ctx(store, "a"), store, cfg, load_teacher(_openai(url), None, asking), asking=asking)
    assert time.perf_counter() - t0 < 10
    rows = sql(store, "SELECT strategy, accepted, reason, teacher_call FROM refinements ORDER BY strategy").to_pylist()
    assert [(r["strategy"], r["accepted"]) for r in rows] == [("ladder", True)] * 2 + [("teacher_scaffold", False)] * 2
    for r in rows:
        call = json.loads(r["teacher_call"])
        assert r["reason"].startswith(f"teacher unavailable: {url}{CHAT_PATH} failed ")
        assert call["response"] is None and call["error"] in r["reason"] and "\n" not in r["reason"]
    # the ladder children carry programmatic distractors only; nothing is cached, the round's refine landed
    assert all(r["reason"].endswith("; programmatic distractors") for r in rows if r["strategy"] == "ladder")
    metas = sql(store, "SELECT meta FROM prompts WHERE transform = 'mcq4'").column("meta").to_pylist()
    assert len(metas) == 2 and all(json.loads(m)["teacher_distractors"] == 0 for m in metas)
    assert _landed_keys(store) == [] and out["children"] == 2 and store.landed("a", 0, "refine")
    # 4 failed calls (2 distractor and 2 scaffold payloads) for 2 prompts; the gate judged none of them
    assert out["teacher_calls"] == 0 and out["teacher_unavailable"] == 2 and out["rejections"] == {}


@pytest.mark.slow
def test_down_teacher_run_completes_then_resumes_with_a_working_teacher(prefect_api, store, monkeypatch):
    """Done-when of issue 11 item 3. 'Resumed with a working teacher' means, precisely: the 2-round run whose
    teacher endpoint is down completes (fallbacks recorded); it is then resumed with teacher.model pointing
    at a working endpoint and rounds 2 -> 3 (allowed, recorded on the resumed row); that process dies right
    after round 1's teacher answers landed, before its refine stage did; the next resume finishes the run.
    The working server sees every question exactly once."""
    from flows.curriculum import curriculum

    down = _openai(f"http://127.0.0.1:{closed_port()}")
    # shape.*: the working teacher's traces verify, so each is shaped (8 traces x 8 steps took ~190 s here)
    # pool.rg_solutions off: shape's candidates have no reference solution, so shape asks the teacher too
    sets = [*TINY, *(f"teacher.{k}={v}" for k, v in FAST.items()), "shape.max_traces=2", "shape.steps=2",
            "pool.rg_solutions=false"]
    out = curriculum(load_config(sets=[*sets, f"teacher.model={down}"], run_id="t", store=store.root, rounds=2))
    shaped = [s for s in out["stages"] if s["stage"] == "shape"]
    assert [s["teacher_unavailable"] > 0 and s["teacher_calls"] == 0 for s in shaped] == [True, True], shaped
    (refined,) = [s for s in out["stages"] if s["stage"] == "refine"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_summary(out)  # what `refinery run` prints at the end
    assert f"round 0: refine made {refined['children']} children (" in printed.getvalue()
    assert f"; teacher unavailable for {refined['teacher_unavailable']} prompts (fell back; see refinements.reason)" \
        in printed.getvalue() and refined["teacher_unavailable"] > 0
    fallbacks = sql(store, """SELECT strategy, accepted, count(*) AS n FROM refinements
                              WHERE reason LIKE 'teacher unavailable: %' GROUP BY ALL ORDER BY ALL""").to_pylist()
    assert [(f["strategy"], f["accepted"]) for f in fallbacks] == [("ladder", True), ("teacher_scaffold", False)]
    assert all(f["n"] > 0 for f in fallbacks) and _landed_keys(store) == []
    assert sql(store, "SELECT status FROM runs ORDER BY created_at").column("status").to_pylist() == [
        "running", "completed"]

    def died_after_the_answers_landed(name):
        if name == "refine:mid":
            raise RuntimeError("injected: the process died here")

    with TeacherServer() as srv:
        working = load_config(sets=[*sets, f"teacher.model={_openai(srv.url)}"], run_id="t", store=store.root,
                              rounds=3)
        monkeypatch.setattr(tasks.refine, "fault_point", died_after_the_answers_landed)
        with pytest.raises(RuntimeError, match="injected"):
            curriculum(working)
        asked_before_the_crash, landed_before_the_crash = srv.count(), set(_landed_keys(store))
        assert asked_before_the_crash > 0 and len(landed_before_the_crash) == asked_before_the_crash
        assert not store.landed("t", 1, "refine")
        monkeypatch.undo()

        out = curriculum(working)
        landed = _landed_keys(store)
        assert len(landed) == len(set(landed)) == srv.count() > asked_before_the_crash
        assert max(srv.asked().values()) == 1  # no question was asked twice, across the crash and resume
        calls = sql(store, """SELECT json_extract_string(teacher_call, '$.key') AS key,
                                      json_extract(teacher_call, '$.reused')::BOOLEAN AS reused
                               FROM refinements WHERE run_id = 't' AND round = 1 AND teacher_call IS NOT NULL
                            """).to_pylist()
        # round 1's refine was served entirely by the answers that landed before the crash
        assert {c["key"] for c in calls} == landed_before_the_crash
        assert calls and all(c["reused"] for c in calls)
    runs = sql(store, "SELECT status, reason FROM runs ORDER BY created_at").to_pylist()
    assert [r["status"] for r in runs] == ["running", "completed", "resumed", "failed", "resumed", "completed"]
    assert runs[2]["reason"] == (f"resumed with changed rounds: 2 -> 3; teacher.model: {down!r} -> "
                                 f"{_openai(srv.url)!r}")
    assert runs[4]["reason"] is None  # resumed with the config it last ran with
    # fields that decide landed data still refuse a resume, naming the field
    with pytest.raises(ValueError, match=r"differs in: rollout\.temperature\)"):
        curriculum(load_config(sets=[*sets, "rollout.temperature=1.0"], run_id="t", store=store.root, rounds=3))


def test_resume_allows_fields_that_cannot_change_landed_data_and_records_them():
    from flows.curriculum import check_resume

    before = load_config(sets=TINY, run_id="r").model_dump(mode="json")
    same = load_config(sets=TINY, run_id="r", store="/elsewhere")
    assert check_resume(same, before) is None  # where the store lives is not how the run runs
    changed = load_config(sets=[*TINY, "model.batch_size=8", "teacher.retries=5",
                                "teacher.model=openai:http://127.0.0.1:9#t"], run_id="r", rounds=4)
    assert check_resume(changed, before) == ("resumed with changed model.batch_size: 64 -> 8; rounds: 2 -> 4; "
                                              "teacher.model: 'policy' -> 'openai:http://127.0.0.1:9#t'; "
                                              "teacher.retries: 3 -> 5")
    for field in ("rollout.temperature=1.0", "teacher.max_new_tokens=32", "model.policy=default"):
        with pytest.raises(ValueError, match=rf"differs in: {field.split('=')[0]}\)"):
            check_resume(load_config(sets=[*TINY, field], run_id="r"), before)


def test_resume_of_a_run_stored_before_a_field_existed():
    """A stored config without a field added since (here teacher.concurrency) is read with that
    field's default, so resuming with the same config is no change; a real change is still refused."""
    from flows.curriculum import check_resume

    before = load_config(sets=TINY, run_id="r").model_dump(mode="json")
    del before["teacher"]["concurrency"]
    assert check_resume(load_config(sets=TINY, run_id="r"), before) is None
    with pytest.raises(ValueError, match=r"differs in: rollout\.temperature\)"):
        check_resume(load_config(sets=[*TINY, "rollout.temperature=1.0"], run_id="r"), before)
    before["refine"]["gone_field"] = 1  # a field since removed: nothing can honour it; the resume says so
    assert check_resume(load_config(sets=TINY, run_id="r"), before) == \
        "resumed without refine.gone_field (no longer a config field)"
