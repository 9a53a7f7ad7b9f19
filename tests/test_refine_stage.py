"""The refine stage over a real store: teacher calls are cached, the ladder promotes, the gate's verdicts
are stored with their reasons."""

import datetime as dt
import json

import pyarrow as pa
import pytest
from conftest import round_ctx

from flows.config import RefineConfig
from storage.query import sql
from tasks.core.ids import prompt_id
from tasks.refine import refine
from tasks.strategies.ladder import make_mcq
from tasks.strategies.teacher_calls import TeacherConfig


class CountingTeacher:
    """A real backend (the tiny model) that counts how often it is asked to generate."""

    def __init__(self, backend):
        self.backend, self.calls, self.name = backend, 0, "counting-tiny"

    def render(self, messages):
        return self.backend.render(messages)

    def generate(self, prompts, n, sampling, progress=None, row_seeds=None):
        self.calls += len(prompts)
        return self.backend.generate(prompts, n, sampling, row_seeds=row_seeds)


def _seed_round(store, run_id, prompts, rewards):
    """Land prompts, and rollouts + scores for round 0 of `run_id` (rewards: prompt index -> list)."""
    from tasks.core.eps import eps_scores

    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    rows = [dict(p, created_at=now) for p in prompts]
    store.commit(f"seed-{run_id}", {"prompts": pa.Table.from_pylist(rows)}) if run_id == "a" else None
    ro = []
    for i, rs in rewards.items():
        for j, r in enumerate(rs):
            ro.append({"run_id": run_id, "round": 0, "policy_version": 0, "prompt_id": prompts[i]["prompt_id"],
                       "sample_idx": j, "prompt_text": prompts[i]["text"], "completion": f"I think {j}",
                       "reward": float(r), "correct": r == 1.0, "n_tokens": 3, "mean_logprob": -1.0,
                       "finish_reason": "stop"})
    import polars as pl

    table = pa.Table.from_pylist(ro)
    store.commit("collect", {"rollouts": table}, run_id=run_id, round=0)
    store.commit("pool", {"pool": pa.table({"run_id": [run_id] * len(prompts), "round": [0] * len(prompts),
                                            "prompt_id": [p["prompt_id"] for p in prompts],
                                            "status": ["active"] * len(prompts)})}, run_id=run_id, round=0)
    store.commit("score", {"prompt_scores": eps_scores(pl.from_arrow(table)).to_arrow()}, run_id=run_id, round=0)


def _original(text, answer, params=None):
    pid = prompt_id(text, answer, "rg:products")
    return {"prompt_id": pid, "text": text, "answer": answer, "source": "rg:products", "root_id": pid,
            "transform": "original", "params": json.dumps(params or {"max_digits": 1}), "meta": "{}",
            "parent_id": None, "solution": None}


def test_teacher_answers_are_reused_not_requested_again(store, tiny_backend):
    prompts = [_original(f"Solve the following multiplication: {a} * {b}.", str(a * b)) for a, b in ((7, 8), (6, 9))]
    cfg, asking = RefineConfig(strategies=["teacher_scaffold"]), TeacherConfig(max_new_tokens=12)
    teacher = CountingTeacher(tiny_backend)
    _seed_round(store, "a", prompts, {0: [0] * 4, 1: [0] * 4})
    out = refine(round_ctx(store, "a"), store, cfg, teacher, asking=asking)
    assert teacher.calls == 2 and out["teacher_calls"] == 2
    assert sql(store, "SELECT count(*) AS n FROM teacher_calls").to_pylist() == [{"n": 2}]
    # a second run with the same prompts and rollouts builds the same payloads: answered from the store
    _seed_round(store, "b", prompts, {0: [0] * 4, 1: [0] * 4})
    again = refine(round_ctx(store, "b"), store, cfg, teacher, asking=asking)
    assert teacher.calls == 2 and again["teacher_calls"] == 0
    calls = sql(store, "SELECT teacher_call FROM refinements WHERE run_id = 'b'").column("teacher_call").to_pylist()
    assert all(json.loads(c)["reused"] for c in calls) and len(calls) == 2
    # and a rerun of a landed stage does nothing at all
    assert refine(round_ctx(store, "a"), store, cfg, teacher, asking=asking)["skipped"] == "already landed" and teacher.calls == 2


def test_ladder_entry_promotion_harden_and_rejections(store):
    hard = _original("Solve the following multiplication: 7 * 8.", "56")
    easy = _original("Solve the following multiplication: 2 * 3.", "6")
    one_digit = _original("Solve the following multiplication: 1 * 3.", "3")
    text, options, _ = make_mcq(hard["prompt_id"], hard["text"], "56", 4)
    mcq4 = dict(hard, prompt_id=prompt_id(text, "56", "rg:products"), text=text, transform="mcq4",
                parent_id=hard["prompt_id"], meta=json.dumps({"options": options, "level": "mcq4"}))
    prompts = [hard, easy, one_digit, mcq4]
    _seed_round(store, "a", prompts, {0: [0] * 4, 1: [1] * 4, 2: [0.5] * 4, 3: [1, 1, 1, 0]})
    cfg = RefineConfig(strategies=["ladder", "harden", "hint_prefix"])
    out = refine(round_ctx(store, "a"), store, cfg, None)
    rows = sql(store, """SELECT r.strategy, r.accepted, r.reason, r.parent_id, p.transform, p.text, p.answer, p.params
                         FROM refinements r LEFT JOIN prompts p ON p.prompt_id = r.child_id""").to_pylist()
    by = {(r["strategy"], r["parent_id"]): r for r in rows}
    # the mcq4 variant (mean 0.75 > 0.5) is promoted to mcq10 of the same root question
    promo = by[("promote", mcq4["prompt_id"])]
    assert promo["accepted"] and promo["transform"] == "mcq10" and "(J)" in promo["text"] and promo["answer"] == "56"
    # the saturated original gets a harder sibling with a new answer and one more digit allowed
    hardened = by[("harden", easy["prompt_id"])]
    assert hardened["accepted"] and json.loads(hardened["params"])["max_digits"] == 2
    # the flat one-digit original enters the ladder at mcq4
    assert by[("ladder", one_digit["prompt_id"])]["transform"] == "mcq4"
    # the too-hard original already has its mcq4 child in the pool: recorded as rejected with the reason
    dup = by[("ladder", hard["prompt_id"])]
    assert not dup["accepted"] and dup["reason"] == "duplicate: already in this run's pool"
    assert out["children"] == 3


@pytest.mark.parametrize("threshold,promoted", [(0.5, True), (0.8, False)])
def test_promotion_rule_threshold(store, threshold, promoted):
    hard = _original("Solve the following multiplication: 7 * 8.", "56")
    text, options, _ = make_mcq(hard["prompt_id"], hard["text"], "56", 4)
    mcq4 = dict(hard, prompt_id=prompt_id(text, "56", "rg:products"), text=text, transform="mcq4",
                parent_id=hard["prompt_id"], meta=json.dumps({"options": options}))
    _seed_round(store, "a", [hard, mcq4], {1: [1, 1, 1, 0]})
    refine(round_ctx(store, "a"), store, RefineConfig(strategies=["ladder"], promote_threshold=threshold), None)
    got = sql(store, "SELECT count(*) AS n FROM refinements WHERE strategy = 'promote'").to_pylist()[0]["n"]
    assert got == (1 if promoted else 0)


def test_hint_annealing_lowers_the_revealed_share_per_promotion(store):
    """A solved hint child (r > threshold) is replaced by one revealing 0.1 less of the solution; at f = 0.1
    the next promotion re-opens the root question."""
    from tasks.strategies.hint import hint_child

    root = dict(_original("Compute 12 * 13 step by step.", "156"),
                solution="12 * 13 = 12 * 10 + 12 * 3 = 120 + 36 so the product is one hundred and fifty six")
    h3, _ = hint_child(root, 0.3, "a", 0)
    h1, _ = hint_child(root, 0.1, "a", 0)
    for h in (h3, h1):
        h.pop("run_id"), h.pop("round")
    _seed_round(store, "a", [root, h3, h1], {1: [1, 1, 1, 0], 2: [1, 1, 0, 1]})
    refine(round_ctx(store, "a"), store, RefineConfig(strategies=["hint_prefix"]), None)
    rows = sql(store, """SELECT r.parent_id, r.child_id, r.accepted, p.transform, p.meta, p.text
                         FROM refinements r LEFT JOIN prompts p ON p.prompt_id = r.child_id
                         WHERE r.strategy = 'promote'""").to_pylist()
    by = {r["parent_id"]: r for r in rows}
    assert by[h3["prompt_id"]]["accepted"] and json.loads(by[h3["prompt_id"]]["meta"])["hint_fraction"] == 0.2
    shorter = by[h3["prompt_id"]]["text"]
    assert shorter.startswith(root["text"]) and len(shorter) < len(h3["text"])
    assert by[h1["prompt_id"]]["child_id"] == root["prompt_id"]  # f 0.1 - 0.1 = 0: the open question again


class ScriptedTeacher(CountingTeacher):
    """The tiny model's backend protocol with fixed replies: the tiny model cannot write numbers on cue, and
    this test is about what is done with a teacher's distractors, not about the teacher's skill."""

    def __init__(self, backend, reply):
        super().__init__(backend)
        self.reply, self.name = reply, "scripted"

    def generate(self, prompts, n, sampling, progress=None, row_seeds=None):
        from models.backend import Completion

        self.calls += len(prompts)
        return [[Completion(self.reply, [0], [-1.0])] for _ in prompts]


def test_teacher_distractors_come_first_and_never_verify(store, tiny_backend):
    hard = _original("Solve the following multiplication: 7 * 8.", "56")
    _seed_round(store, "a", [hard], {0: [0] * 4})
    teacher = ScriptedTeacher(tiny_backend, "1. 54\n2. 56\n3) 63\n- 48\nfifty-six")
    out = refine(round_ctx(store, "a"), store, RefineConfig(strategies=["ladder"]), teacher)
    assert teacher.calls == 1 and out["children"] == 1
    (row,) = sql(store, """SELECT p.meta, r.teacher_call FROM refinements r JOIN prompts p
                           ON p.prompt_id = r.child_id""").to_pylist()
    meta = json.loads(row["meta"])
    assert meta["teacher_distractors"] == 3  # 54, 63, 48; '56' is the answer and 'fifty-six' is not a number
    assert sorted(o for o in meta["options"] if o != "56") == ["48", "54", "63"]
    assert json.loads(row["teacher_call"])["key"]
    # with the teacher switched off for distractors, the ladder makes them programmatically and asks nobody
    _seed_round(store, "b", [hard], {0: [0] * 4})
    refine(round_ctx(store, "b"), store, RefineConfig(strategies=["ladder"], teacher_distractors=False), teacher)
    assert teacher.calls == 1


def test_policy_teacher_distractors_through_the_real_backend(store, tiny_backend):
    """The tiny model as teacher: its replies are noise, so programmatic distractors fill every slot, the
    child is still valid, and the call is stored and reused."""
    hard = _original("Solve the following multiplication: 7 * 8.", "56")
    _seed_round(store, "a", [hard], {0: [0] * 4})
    teacher = CountingTeacher(tiny_backend)
    out = refine(round_ctx(store, "a"), store, RefineConfig(strategies=["ladder"]), teacher,
                 asking=TeacherConfig(max_new_tokens=8))
    assert teacher.calls == 1 and out["children"] == 1
    assert sql(store, "SELECT count(*) AS n FROM teacher_calls").to_pylist() == [{"n": 1}]


def _rejections_in_sql(store, run_id):
    """Rejections per stable reason category, counted the way a user would in SQL."""
    rows = sql(store, f"""SELECT split_part(reason, ':', 1) AS category, count(*) AS n FROM refinements
                          WHERE run_id = '{run_id}' AND NOT accepted GROUP BY 1""").to_pylist()
    return {r["category"]: r["n"] for r in rows}


def test_tiny_random_teacher_gets_no_scaffold_into_the_pool(store, tiny_backend):
    """The tiny random model as teacher, through the real refine stage: its rewrites are BPE noise, and none
    is accepted; the summary's rejections per category are the SQL counts."""
    from tasks.strategies.gate import mean_logprobs

    pairs = ((7, 8), (6, 9), (3, 4), (5, 7), (2, 9), (8, 4))
    prompts = [_original(f"Solve the following multiplication: {a} * {b}.", str(a * b)) for a, b in pairs]
    _seed_round(store, "a", prompts, {i: [0] * 4 for i in range(len(prompts))})
    cfg = RefineConfig(strategies=["teacher_scaffold"])
    teacher = CountingTeacher(tiny_backend)
    out = refine(round_ctx(store, "a"), store, cfg, teacher, logprobs=lambda texts: mean_logprobs(tiny_backend, texts),
                 asking=TeacherConfig(max_new_tokens=40))
    assert teacher.calls == len(prompts) and out["children"] == 0
    rows = sql(store, "SELECT accepted, reason FROM refinements WHERE strategy = 'teacher_scaffold'").to_pylist()
    assert len(rows) == len(prompts) and not any(r["accepted"] for r in rows)
    assert sql(store, "SELECT count(*) AS n FROM prompts WHERE transform = 'teacher_scaffold'").to_pylist() == [
        {"n": 0}]
    assert out["rejections"] == _rejections_in_sql(store, "a") and sum(out["rejections"].values()) == len(prompts)
    assert set(out["rejections"]) <= {"drops quantities", "not language", "off topic", "too short"}


class RewritingTeacher(CountingTeacher):
    """The backend protocol with a fixed rewrite per problem (the first key found in the prompt): what the
    gate does with each kind of answer, whatever model would write it."""

    def __init__(self, backend, replies: dict[str, str]):
        super().__init__(backend)
        self.replies, self.name = replies, "rewriting"

    def generate(self, prompts, n, sampling, progress=None, row_seeds=None):
        from models.backend import Completion

        self.calls += len(prompts)
        return [[Completion(next(r for k, r in self.replies.items() if k in p), [0], [-1.0])] for p in prompts]


def test_gate_verdicts_land_with_their_categories(store, tiny_backend):
    """A well-formed scaffold joins the pool; off-topic, number-dropping, noisy and parroting ones are
    rejected, each with its category, countable in SQL and in the stage summary."""
    noise = ("rylic hitherto repeat judgeublic emer interviewkonlawsidden seek Conversion monoxide tract "
             "natunicode fructose Mack rural Nim begun newspaper gatheribidsorSure inappropriateellowsNs")
    replies = {
        "7 * 8": "Solve the following multiplication: 7 * 8. Think of seven groups of eight and add them up.",
        "6 * 9": "My 6 cats and 9 dogs love long walks in the park on sunny afternoons.",
        "3 * 4": "I'm sorry for your loss, but I'm sorry for the confusion. This is a classic example.",
        "5 * 7": f"5 * 7 {noise}",
        "2 * 9": "The student's attempts and their rewards (1 = correct) show that 2 * 9 is hard.",
    }
    prompts = [_original(f"Solve the following multiplication: {q}.", str(eval(q))) for q in replies]
    _seed_round(store, "a", prompts, {i: [0] * 4 for i in range(len(prompts))})
    out = refine(round_ctx(store, "a"), store, RefineConfig(strategies=["teacher_scaffold"]), RewritingTeacher(tiny_backend, replies))
    rows = sql(store, """SELECT p.text AS parent, r.accepted, r.reason, c.transform FROM refinements r
                         JOIN prompts p ON p.prompt_id = r.parent_id
                         LEFT JOIN prompts c ON c.prompt_id = r.child_id""").to_pylist()
    by = {next(q for q in replies if q in r["parent"]): r for r in rows}
    assert by["7 * 8"]["accepted"] and by["7 * 8"]["transform"] == "teacher_scaffold" and out["children"] == 1
    got = {q: r["reason"].split(":")[0] for q, r in by.items() if not r["accepted"]}
    assert got == {"6 * 9": "off topic", "3 * 4": "drops quantities", "5 * 7": "not language",
                   "2 * 9": "echoes prompt"}
    assert out["rejections"] == _rejections_in_sql(store, "a") == {
        "drops quantities": 1, "echoes prompt": 1, "not language": 1, "off topic": 1}


def test_an_empty_answer_is_no_gate_rejection(store, tiny_backend):
    """A teacher that answers with nothing: the row says so under its own category, and the summary's gate
    rejections (what `refinery run` prints as "rejected N children") do not count it."""
    prompts = [_original(f"Solve the following multiplication: {q}.", str(eval(q))) for q in ("7 * 8", "6 * 9")]
    _seed_round(store, "a", prompts, {0: [0] * 4, 1: [0] * 4})
    replies = {"7 * 8": "", "6 * 9": "My 6 cats and 9 dogs love long walks in the park on sunny afternoons."}
    out = refine(round_ctx(store, "a"), store, RefineConfig(strategies=["teacher_scaffold"]), RewritingTeacher(tiny_backend, replies))
    assert _rejections_in_sql(store, "a") == {"empty answer": 1, "off topic": 1}
    assert out["rejections"] == {"off topic": 1} and out["teacher_unavailable"] == 0


def test_policy_teacher_scaffolds_stay_off_unless_asked(store):
    """refine_task, as the flow runs it: with teacher.model = 'policy' (the default) no scaffold is asked for;
    scaffolds_from_policy turns them on, and the tiny policy's rewrites are then all rejected."""
    from flows.config import ModelConfig
    from tasks.refine import refine_task

    prompts = [_original(f"Solve the following multiplication: {a} * {b}.", str(a * b)) for a, b in ((7, 8), (6, 9))]
    _seed_round(store, "a", prompts, {0: [0] * 4, 1: [0] * 4})
    model = ModelConfig(policy="tiny-random")
    cfg, asking = RefineConfig(strategies=["teacher_scaffold"]), TeacherConfig(max_new_tokens=24)
    off = refine_task.fn(round_ctx(store, "a", model=model), cfg, asking)
    assert off["refinements"] == 0 and off["teacher_scaffold"].startswith("off: the teacher is the policy")
    _seed_round(store, "b", prompts, {0: [0] * 4, 1: [0] * 4})
    on = refine_task.fn(round_ctx(store, "b", model=model), cfg.model_copy(update={"scaffolds_from_policy": True}),
                         asking)
    assert on["teacher_calls"] == 2 and on["children"] == 0 and "teacher_scaffold" not in on
    assert sum(on["rejections"].values()) == 2 == sum(_rejections_in_sql(store, "b").values())


class RecordingTeacher(CountingTeacher):
    """The tiny model, keeping every prompt it was asked."""

    def __init__(self, backend):
        super().__init__(backend)
        self.asked: list[str] = []

    def generate(self, prompts, n, sampling, progress=None, row_seeds=None):
        self.asked += prompts
        return super().generate(prompts, n, sampling, row_seeds=row_seeds)


def test_the_teacher_sees_the_students_own_attempts_not_lope_rescues(store, tiny_backend):
    """A LoPE replacement was sampled under a Lorem-Ipsum prefix and trains the policy only: the teacher_scaffold
    payload shows the policy's own (failed) attempts, never the rescue's correct completion."""
    import polars as pl

    from tasks.core.eps import eps_scores

    p = _original("Solve the following multiplication: 7 * 8.", "56")
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    store.commit("seed-a", {"prompts": pa.Table.from_pylist([dict(p, created_at=now)])})
    rescue = json.dumps({"lorem_perturb": {"replaced": True, "own_reward": 0.0}})
    rows = [{"run_id": "a", "round": 0, "policy_version": 0, "prompt_id": p["prompt_id"], "sample_idx": j,
             "prompt_text": p["text"], "completion": (f"RESCUED {j}: the answer is \\boxed{{56}}" if j >= 2
                                                      else f"I think {j}"),
             "reward": 1.0 if j >= 2 else 0.0, "correct": j >= 2, "n_tokens": 3, "mean_logprob": -1.0,
             "finish_reason": "stop", "augmentation": rescue if j >= 2 else None} for j in range(4)]
    table = pa.Table.from_pylist(rows)
    store.commit("collect", {"rollouts": table}, run_id="a", round=0)
    store.commit("pool", {"pool": pa.table({"run_id": ["a"], "round": [0], "prompt_id": [p["prompt_id"]],
                                            "status": ["active"]})}, run_id="a", round=0)
    own = pl.from_arrow(table).with_columns(pl.lit(0.0).alias("reward"), pl.lit(False).alias("correct"))
    store.commit("score", {"prompt_scores": eps_scores(own).to_arrow()}, run_id="a", round=0)
    teacher = RecordingTeacher(tiny_backend)
    refine(round_ctx(store, "a"), store, RefineConfig(strategies=["teacher_scaffold"]), teacher,
           asking=TeacherConfig(max_new_tokens=8))
    assert len(teacher.asked) == 1
    assert "I think 0" in teacher.asked[0] and "I think 1" in teacher.asked[0]
    assert "RESCUED" not in teacher.asked[0]


def test_a_teacher_answer_does_not_depend_on_what_is_asked_with_it(tmp_path, tiny_backend):
    """Keyed sampling per call key: asked alone, or in a batch with others in another order, a prompt gets
    the same answer (before, a batch drew from one seed in row order)."""
    from storage.store import Store
    from tasks.strategies.teacher_calls import ask_teacher

    payloads = {f"k{i}": f"Problem {i}: what is {i} + {i}?" + " Think it through." * i for i in range(5)}  # widths differ
    answers = []
    for name, keys in (("batch", ["k0", "k1", "k2", "k3", "k4"]), ("alone", ["k3"]), ("other", ["k4", "k3", "k1"])):
        cache: dict = {}
        fresh, failed = ask_teacher(Store(tmp_path / name), tiny_backend, {k: payloads[k] for k in keys}, cache,
                                    12, temperature=1.0)
        assert fresh == set(keys) and not failed
        answers.append(cache["k3"])
    assert answers[0] == answers[1] == answers[2] and answers[0]
