import json

import polars as pl
import pytest
from conftest import round_ctx

from tasks.core.fewshot import fewshot_messages, fewshot_probability


def _prompts(n, source="rg:products"):
    return pl.DataFrame({"prompt_id": [f"p{i}" for i in range(n)], "text": [f"Q{i}?" for i in range(n)],
                         "source": [source] * n, "root_id": [f"p{i}" for i in range(n)]})  # each its own lineage


def _demos():
    return pl.DataFrame({"prompt_id": ["p0", "p1", "p2", "z0"], "source": ["rg:products"] * 3 + ["rg:chain_sum"],
                         "root_id": ["p0", "p1", "p2", "z0"],
                         "question": ["Q0?", "Q1?", "Q2?", "Z?"], "completion": ["A0", "A1", "A2", "AZ"]})


def test_schedule_decays_to_zero():
    got = [fewshot_probability(t, 5, 0.5) for t in range(6)]
    assert got == pytest.approx([0.5, 0.4, 0.3, 0.2, 0.1, 0.0])


def test_demonstrations_are_solved_siblings_never_the_prompt_itself():
    msgs, recs = fewshot_messages(_prompts(3), _demos(), 0, 0, 1, p0=1.0, k=2, instruction="Box it.")
    for i, (m, r) in enumerate(zip(msgs, recs)):
        used = json.loads(r)["fewshot_context"]
        assert len(used) == 2 and f"p{i}" not in used and "z0" not in used  # same source, other prompts
        assert [t["role"] for t in m] == ["user", "assistant", "user", "assistant", "user"]
        assert m[-1]["content"] == f"Q{i}?\nBox it." and m[1]["content"] in ("A0", "A1", "A2")


def test_probability_zero_or_k_zero_or_no_siblings_means_plain_prompts():
    for kwargs in ({"p0": 0.0, "k": 2}, {"p0": 1.0, "k": 0}):
        msgs, recs = fewshot_messages(_prompts(3), _demos(), 0, 0, 1, instruction="", **kwargs)
        assert recs == [None] * 3 and all(len(m) == 1 for m in msgs)
    msgs, recs = fewshot_messages(_prompts(2, "rg:other"), _demos(), 0, 0, 1, p0=1.0, k=2, instruction="")
    assert recs == [None, None]


def test_the_draw_is_seeded_and_follows_p():
    many = _prompts(400)
    a = fewshot_messages(many, _demos(), 0, 1, 2, p0=0.5, k=1, instruction="")[1]
    b = fewshot_messages(many, _demos(), 0, 1, 2, p0=0.5, k=1, instruction="")[1]
    assert a == b
    share = sum(r is not None for r in a) / len(a)
    assert 0.17 < share < 0.33  # p_1 = 0.5 * (1 - 1/2) = 0.25


def test_collect_records_fewshot_demonstrations(store):
    """Round 1 of a run whose round 0 solved some prompts: rollouts carry their demonstrations."""
    import datetime as dt

    import pyarrow as pa
    from test_curriculum import TINY

    from flows.config import load_config
    from storage.query import sql
    from tasks.collect import collect_task

    cfg = load_config(sets=[*TINY, "rollout.fewshot_p0=1.0", "rollout.fewshot_k=1", "rollout.lope_prefixes=0"])
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    ids = [f"q{i}" for i in range(3)]
    store.commit("seed", {"prompts": pa.table({
        "prompt_id": ids, "text": [f"What is {i} + 1?" for i in range(3)], "answer": [str(i + 1) for i in range(3)],
        "source": ["rg:chain_sum"] * 3, "root_id": ids, "transform": ["original"] * 3, "created_at": [now] * 3})})
    store.commit("collect", {"rollouts": pa.table({
        "run_id": ["a"] * 3, "round": [0] * 3, "policy_version": [0] * 3, "prompt_id": ids, "sample_idx": [0] * 3,
        "prompt_text": ["x"] * 3, "completion": [r"\boxed{1}", r"\boxed{2}", "no"], "reward": [1.0, 1.0, 0.0],
        "correct": [True, True, False], "n_tokens": [3] * 3, "mean_logprob": [-1.0] * 3,
        "finish_reason": ["stop"] * 3})}, run_id="a", round=0)
    store.commit("pool", {"pool": pa.table({"run_id": ["a"] * 3, "round": [1] * 3, "prompt_id": ids,
                                            "status": ["active"] * 3})}, run_id="a", round=1)
    collect_task.fn(round_ctx(store, "a", 1, model=cfg.model, rounds=4), cfg.rollout, cfg.reward, cfg.select)
    rows = sql(store, "SELECT prompt_id, any_value(augmentation) AS aug, any_value(prompt_text) AS p, count(*) AS n "
                      "FROM rollouts WHERE round = 1 GROUP BY 1 ORDER BY 1").to_pylist()
    assert [r["n"] for r in rows] == [4, 4, 4]
    for r in rows:  # p_1 = 1.0 * (1 - 1/4) < 1, so a prompt may go without; those that got one show it
        if r["aug"]:
            (demo,) = json.loads(r["aug"])["fewshot_context"]
            assert demo in ("q0", "q1") and demo != r["prompt_id"]
            assert r"\boxed{" in r["p"]  # the demonstration's solved completion is in the rendered prompt
    assert any(r["aug"] for r in rows)


# ---- lineage: a prompt's own rungs and rewrites share its answer, so none of them may demonstrate it ----------

SEVEN_EIGHT = "What is 7*8?"


def _seven_eight_lineage():
    """The root "What is 7*8?", its solved mcq4 rung (ending in \\boxed{56}), its mcq10 rung (the target), and
    an unrelated solved prompt of the same source."""
    prompts = pl.DataFrame({"prompt_id": ["root", "m4", "m10", "other"],
                            "text": [SEVEN_EIGHT, f"{SEVEN_EIGHT}\nOptions: (A) 54 (B) 56 ...",
                                     f"{SEVEN_EIGHT}\nOptions: (A) 48 ... (J) 65", "What is 3*4?"],
                            "source": ["rg:products"] * 4, "root_id": ["root", "root", "root", "other"]})
    demos = pl.DataFrame({"prompt_id": ["m4", "root", "other"], "source": ["rg:products"] * 3,
                          "root_id": ["root", "root", "other"],
                          "question": [prompts["text"][1], SEVEN_EIGHT, "What is 3*4?"],
                          "completion": [r"7*8 is \boxed{56}", r"\boxed{56}", r"\boxed{12}"]})
    return prompts, demos


def test_a_ladder_rung_never_sees_its_solved_sibling_rung():
    """The constructed leak of issue 12: the mcq10 rung of "What is 7*8?" got its solved mcq4 sibling, whose
    completion ends in \\boxed{56}, as an earlier turn. Only the unrelated prompt may demonstrate it."""
    prompts, demos = _seven_eight_lineage()
    msgs, recs = fewshot_messages(prompts, demos, 0, 0, 1, p0=1.0, k=2, instruction="")
    by_id = dict(zip(prompts["prompt_id"], zip(msgs, recs)))
    for pid in ("root", "m4", "m10"):
        m, r = by_id[pid]
        assert json.loads(r)["fewshot_context"] == ["other"], (pid, r)
        assert not any(r"\boxed{56}" in t["content"] for t in m), pid
    assert by_id["other"][1] is not None and set(json.loads(by_id["other"][1])["fewshot_context"]) <= {"m4", "root"}


def test_without_lineage_columns_fewshot_refuses_instead_of_leaking():
    prompts, demos = _seven_eight_lineage()
    with pytest.raises(ValueError, match="root_id"):
        fewshot_messages(prompts.drop("root_id"), demos, 0, 0, 1, p0=1.0, k=2, instruction="")
    with pytest.raises(ValueError, match="root_id"):
        fewshot_messages(prompts, demos.drop("root_id"), 0, 0, 1, p0=1.0, k=2, instruction="")
    # no demonstration can be added (k = 0 or p = 0): the lineage is not needed, as in rescoring
    assert fewshot_messages(prompts.drop("root_id"), pl.DataFrame(), 0, 0, 1, 0.0, 0, "")[1] == [None] * 4


def test_property_no_demonstration_ever_shares_the_targets_lineage():
    """Random pools of lineages (a root and its variants, all of one source and one answer) over a few sources:
    whatever the draw, every demonstration has the target's source and another root, no earlier turn carries a
    completion of the target's lineage, and at p = 1 a prompt gets k demonstrations when enough are eligible."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    lineage = st.tuples(st.sampled_from(["rg:a", "rg:b", "rg:c"]), st.integers(1, 4), st.integers(0, 4))

    @settings(max_examples=150, deadline=None, derandomize=True)
    @given(st.lists(lineage, min_size=1, max_size=8), st.integers(1, 3), st.integers(0, 3))
    def check(lineages, k, round):
        rows, demo_rows = [], []
        for li, (source, n_variants, n_solved) in enumerate(lineages):
            for v in range(n_variants):
                pid = f"L{li}v{v}"
                rows.append({"prompt_id": pid, "text": f"Q{li}.{v}", "source": source, "root_id": f"L{li}v0"})
                if v < n_solved:
                    demo_rows.append({"prompt_id": pid, "source": source, "root_id": f"L{li}v0",
                                      "question": f"Q{li}.{v}", "completion": f"answer of lineage {li}"})
        prompts = pl.DataFrame(rows)
        demos = pl.DataFrame(demo_rows, schema=["prompt_id", "source", "root_id", "question", "completion"])
        msgs, recs = fewshot_messages(prompts, demos, 0, round, 4, p0=1.0, k=k, instruction="")
        root_of = dict(zip(prompts["prompt_id"], prompts["root_id"]))
        source_of = dict(zip(prompts["prompt_id"], prompts["source"]))
        for row, m, r in zip(prompts.iter_rows(named=True), msgs, recs):
            used = json.loads(r)["fewshot_context"] if r else []
            assert all(root_of[d] != row["root_id"] and source_of[d] == row["source"] for d in used)
            lineage_no = row["root_id"][1:].split("v")[0]
            assert not any(f"lineage {lineage_no}" in t["content"] for t in m[:-1])
            eligible = {d["prompt_id"] for d in demo_rows
                        if d["source"] == row["source"] and d["root_id"] != row["root_id"]}
            if r is not None:
                assert len(used) == min(k, len(eligible))
            assert (r is not None) == bool(eligible) or round > 0  # p_0 = 1: every prompt that can get one does

    check()


def test_collect_never_shows_a_rung_its_own_lineage(store):
    """Through the store and the rollout stage: round 0 solved the mcq4 rung of "What is 7*8?" and an unrelated
    prompt; in round 1 the mcq10 rung (same root) may only be shown the unrelated one, and no rendered
    prompt of the lineage carries \\boxed{56}."""
    import datetime as dt

    import pyarrow as pa
    from test_curriculum import TINY

    from flows.config import load_config
    from storage.query import sql
    from tasks.collect import collect_task

    cfg = load_config(sets=[*TINY, "rollout.fewshot_p0=1.0", "rollout.fewshot_k=2", "rollout.lope_prefixes=0",
                            "rollout.group_size=2"])
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    ids = ["root", "m4", "m10", "other"]
    store.commit("seed", {"prompts": pa.table({
        "prompt_id": ids, "text": [SEVEN_EIGHT, f"{SEVEN_EIGHT} (mcq4)", f"{SEVEN_EIGHT} (mcq10)", "What is 3*4?"],
        "answer": ["56", "56", "56", "12"], "source": ["rg:products"] * 4, "root_id": ["root", "root", "root", "other"],
        "transform": ["original", "mcq4", "mcq10", "original"], "created_at": [now] * 4})})
    store.commit("collect", {"rollouts": pa.table({
        "run_id": ["a"] * 2, "round": [0] * 2, "policy_version": [0] * 2, "prompt_id": ["m4", "other"],
        "sample_idx": [0] * 2, "prompt_text": ["x"] * 2, "completion": [r"\boxed{56}", r"\boxed{12}"],
        "reward": [1.0] * 2, "correct": [True] * 2, "n_tokens": [3] * 2, "mean_logprob": [-1.0] * 2,
        "finish_reason": ["stop"] * 2})}, run_id="a", round=0)
    store.commit("pool", {"pool": pa.table({"run_id": ["a"] * 2, "round": [1] * 2, "prompt_id": ["m10", "other"],
                                            "status": ["active"] * 2})}, run_id="a", round=1)
    collect_task.fn(round_ctx(store, "a", 1, model=cfg.model, rounds=100), cfg.rollout, cfg.reward, cfg.select)
    rows = sql(store, "SELECT prompt_id, any_value(augmentation) AS aug, any_value(prompt_text) AS p "
                      "FROM rollouts WHERE round = 1 GROUP BY 1 ORDER BY 1").to_pylist()
    got = {r["prompt_id"]: r for r in rows}
    assert json.loads(got["m10"]["aug"])["fewshot_context"] == ["other"]  # p_1 = 0.99: drawn for this seed
    assert r"\boxed{56}" not in got["m10"]["p"] and r"\boxed{12}" in got["m10"]["p"]
    assert json.loads(got["other"]["aug"])["fewshot_context"] == ["m4"]  # another lineage may show it
