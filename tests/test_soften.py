"""soften (tasks/strategies/soften.py, docs/algorithms.md §3.5): a too-hard arithmetic prompt steps down one rung
made from its own numbers, each rung is gated and linked by lineage, and the lineage climbs back to the root as
the policy passes its rungs; over a real store, the refine stage and the pool's rules."""

import datetime as dt
import json

import polars as pl
import pyarrow as pa
import pytest
from conftest import round_ctx, run_cli

from flows.config import RefineConfig
from storage.query import sql
from storage.store import Store
from tasks.core.eps import eps_scores
from tasks.core.pool_rules import next_pool
from tasks.core.rewards import rg_score
from tasks.core.sources import rg_rows
from tasks.refine import refine
from tasks.strategies.gate import Lengths
from tasks.strategies.soften import can_soften, soften_expression, softened_row

RUN = "soft"


@pytest.mark.parametrize("expression,easier", [
    ("42 * 25", "42 * 5"), ("42 * 5", "2 * 5"), ("2 * 5", None),           # 2x2 -> 2x1 -> the times table
    ("57 + 87", "57 + 7"), ("10 - 99", "10 - 9"), ("10 - 9", "1 - 9"),      # the last widest loses its lead digit
    ("20 * 3", "2 * 3"), ("305 + 1", "30 + 1"), ("12 * 21", "12 * 2"),     # not to 0 or x1, not two digits at once
    ("3 + 4 + 5", "3 + 4"), ("3 - -4", None), ("-12 * 5", "-2 * 5"), ("10 * 7", None),  # then terms; no x1
    ("(12 + 3) * 4", None), ("84 / 4", None), ("7", None), ("1e3 + 2", None),  # forms it leaves alone
])
def test_one_step_down(expression, easier):
    assert soften_expression(expression) == easier


def _item(task="products", **params):
    row = rg_rows(task, 1, 3, params)[0]
    return {"prompt_id": row.prompt_id, "text": row.text, "answer": row.answer, "source": row.source,
            "params": row.params, "meta": row.meta, "solution": row.solution, "parent_id": None,
            "root_id": row.prompt_id, "transform": "original"}


@pytest.mark.parametrize("task,params", [("products", {"min_digits": 2, "max_digits": 2}),
                                         ("chain_sum", {"min_digits": 2, "max_digits": 2, "min_terms": 3,
                                                        "max_terms": 3})])
def test_a_softened_child_is_a_verified_problem_with_its_own_solution(task, params):
    root = _item(task, **params)
    child, reason = softened_row(root, root, RUN, 0)
    assert reason is None, reason
    meta, root_meta = json.loads(child["meta"]), json.loads(root["meta"])
    assert meta["expression"] == soften_expression(root_meta["expression"]) and meta["soften_depth"] == 1
    assert child["text"] == root["text"].replace(root_meta["expression"], meta["expression"])
    # reasoning-gym's own scorer accepts the child's answer, and its worked solution ends in it
    assert rg_score(child["answer"], child["answer"], task, child["text"], child["meta"]) == 1.0
    assert child["answer"] != root["answer"] and child["solution"].endswith(f"\\boxed{{{child['answer']}}}")
    assert (child["parent_id"], child["root_id"], child["transform"], child["params"]) == (
        root["prompt_id"], root["prompt_id"], "soften", root["params"])
    operands = meta["expression"].replace("*", "+").replace("-", "+").split("+")
    assert meta["level"] == "digits " + ",".join(str(len(n.strip())) for n in operands)


def test_the_gate_judges_every_rung_and_unsupported_sources_say_why():
    root = _item(min_digits=2, max_digits=2)
    child, reason = softened_row(root, root, RUN, 0, Lengths(min_chars=500, max_chars=4000))
    assert child is not None and reason.startswith("too short")
    twice = dict(root, text=root["text"] + " " + json.loads(root["meta"])["expression"])
    assert softened_row(twice, twice, RUN, 0) == (None, "unsupported: soften needs the item's expression, once "
                                                        "in its text")
    gcd = dict(root, source="rg:gcd")
    assert softened_row(gcd, gcd, RUN, 0) == (None, "unsupported: soften needs an rg: source of products, "
                                                    "chain_sum, basic_arithmetic")
    bottom = dict(root, text="Solve the following multiplication: 2 * 5.", meta=json.dumps({"expression": "2 * 5"}))
    assert softened_row(bottom, bottom, RUN, 0)[1] == "unsupported: at the minimum ('2 * 5' has no easier step)"


def _round(store, rnd: int, pool: pl.DataFrame, rewards: dict[str, list[float]]) -> pl.DataFrame:
    """Land round `rnd`: its pool, rollouts of `rewards` (prompt id -> rewards) and their scores; run refine;
    return the next round's pool as the pool rules make it."""
    texts = {r["prompt_id"]: r["text"] for r in sql(store, "SELECT prompt_id, text FROM prompts").to_pylist()}
    ro = [{"run_id": RUN, "round": rnd, "policy_version": rnd, "prompt_id": pid, "sample_idx": j,
           "prompt_text": texts[pid], "completion": "x", "reward": float(r), "correct": r == 1.0, "n_tokens": 3,
           "mean_logprob": -1.0, "finish_reason": "stop"} for pid, rs in rewards.items() for j, r in enumerate(rs)]
    table = pa.Table.from_pylist(ro)
    store.commit("pool", {"pool": pool.to_arrow()}, run_id=RUN, round=rnd)
    store.commit("collect", {"rollouts": table}, run_id=RUN, round=rnd)
    scores = eps_scores(pl.from_arrow(table))
    store.commit("score", {"prompt_scores": scores.to_arrow()}, run_id=RUN, round=rnd)
    refine(round_ctx(store, RUN, rnd), store, RefineConfig(strategies=["soften"]), None)
    kinds = pl.from_arrow(sql(store, "SELECT prompt_id, transform FROM prompts"))
    refinements = pl.from_arrow(sql(store, f"SELECT * FROM refinements WHERE run_id = '{RUN}' AND round = {rnd}"))
    return next_pool(pool, scores, kinds, rnd + 1, refinements)


def test_a_lineage_steps_down_to_the_frontier_and_climbs_back_to_its_root(store):
    root = _item(min_digits=2, max_digits=2)
    store.commit("seed", {"prompts": pa.Table.from_pylist([dict(root, created_at=dt.datetime(2026, 1, 1,
                                                                                             tzinfo=dt.UTC))])})
    pool = pl.DataFrame({"run_id": [RUN], "round": [0], "prompt_id": [root["prompt_id"]], "status": ["active"],
                         "level": [None]}, schema_overrides={"round": pl.Int32, "level": pl.String})

    def status(p, pid):
        return dict(zip(p["prompt_id"], p["status"]))[pid]

    def last_row(strategy):
        rows = sql(store, f"SELECT r.*, p.transform, p.meta FROM refinements r LEFT JOIN prompts p "
                          f"ON p.prompt_id = r.child_id WHERE strategy = '{strategy}' ORDER BY round").to_pylist()
        return rows[-1]

    pool = _round(store, 0, pool, {root["prompt_id"]: [0] * 4})  # too hard: a 2x1 rung
    c1 = last_row("soften")
    assert c1["accepted"] and c1["parent_id"] == root["prompt_id"] and json.loads(c1["meta"])["level"] == "digits 2,1"
    assert status(pool, root["prompt_id"]) == "reserve" and status(pool, c1["child_id"]) == "active"

    pool = _round(store, 1, pool, {c1["child_id"]: [0] * 4})  # the rung is too hard too: one more step, it retires
    c2 = last_row("soften")
    assert c2["accepted"] and c2["parent_id"] == c1["child_id"] and json.loads(c2["meta"])["soften_depth"] == 2
    assert status(pool, c1["child_id"]) == "retired" and status(pool, c2["child_id"]) == "active"
    lineage = sql(store, f"SELECT root_id FROM prompts WHERE prompt_id = '{c2['child_id']}'").to_pylist()
    assert lineage == [{"root_id": root["prompt_id"]}]

    pool = _round(store, 2, pool, {c2["child_id"]: [1, 1, 1, 0]})  # passed: back up to the 2x1 rung
    up = last_row("promote")
    assert up["accepted"] and (up["parent_id"], up["child_id"]) == (c2["child_id"], c1["child_id"])
    assert status(pool, c2["child_id"]) == "retired" and status(pool, c1["child_id"]) == "active"

    pool = _round(store, 3, pool, {c1["child_id"]: [1, 1, 0, 1]})  # passed: the root question comes back
    up = last_row("promote")
    assert up["accepted"] and (up["parent_id"], up["child_id"]) == (c1["child_id"], root["prompt_id"])
    assert status(pool, root["prompt_id"]) == "active" and status(pool, c1["child_id"]) == "retired"

    pool = _round(store, 4, pool, {root["prompt_id"]: [0] * 4})  # still too hard: no cycle, it stays in reserve
    again = last_row("soften")
    assert not again["accepted"] and again["reason"] == "duplicate: already in this run's pool"
    assert status(pool, root["prompt_id"]) == "reserve"
    assert sql(store, "SELECT count(*) AS n FROM prompts WHERE transform = 'soften'").to_pylist() == [{"n": 2}]


def test_a_rung_at_the_minimum_takes_no_soften_slot(store):
    """A too-hard rung with no step down (a one-digit product) and a source soften does not know are not proposed:
    a rejected proposal would be written, and charged a slot of the round's cap, every round."""
    root = _item(min_digits=2, max_digits=2)
    assert can_soften(root) and not can_soften(dict(root, source="rg:gcd"))
    store.commit("seed", {"prompts": pa.Table.from_pylist([dict(root, created_at=dt.datetime(2026, 1, 1,
                                                                                             tzinfo=dt.UTC))])})
    pool = pl.DataFrame({"run_id": [RUN], "round": [0], "prompt_id": [root["prompt_id"]], "status": ["active"],
                         "level": [None]}, schema_overrides={"round": pl.Int32, "level": pl.String})
    pool = _round(store, 0, pool, {root["prompt_id"]: [0] * 4})
    pool = _round(store, 1, pool, {pool.filter(pl.col("status") == "active")["prompt_id"][0]: [0] * 4})
    bottom = pool.filter(pl.col("status") == "active")["prompt_id"][0]
    meta = json.loads(sql(store, f"SELECT meta FROM prompts WHERE prompt_id = '{bottom}'").to_pylist()[0]["meta"])
    assert meta["level"] == "digits 1,1" and soften_expression(meta["expression"]) is None
    _round(store, 2, pool, {bottom: [0] * 4})  # still too hard, and no easier step
    assert sql(store, "SELECT count(*) AS n FROM refinements WHERE round = 2").to_pylist() == [{"n": 0}]


def test_refinery_run_softens_too_hard_products_by_default_and_collects_the_rungs(tmp_path, prefect_api):
    """Wired in: the default strategies soften a scripted policy's all-fail two-digit products, and the next
    round's selection draws the rungs."""
    sets = ["model.policy=tiny-random", "model.backend=scripted", "model.dtype=fp32", "rollout.group_size=4",
            "rollout.max_new_tokens=40", "rollout.fewshot_p0=0.0", "rollout.screen_samples=0",
            "select.selector=uniform", "select.batch_size=64", "select.embedder=hashing", "shape.enabled=false",
            "train.enabled=false", "eval.enabled=false", "governor.enabled=false",
            'pool.sources=[{"source": "rg:products", "size": 40, "params": {"min_digits": 2, "max_digits": 2}}]']
    code, out, err = run_cli("run", "--run-id", "soft", "--rounds", "2", "--store", str(tmp_path / "store"),
                             *[a for s in sets for a in ("--set", s)])
    assert code == 0, err
    store = Store(tmp_path / "store")
    made = sql(store, """SELECT r.parent_id, r.child_id, c.root_id, c.meta, s.bucket FROM refinements r
                         JOIN prompts c ON c.prompt_id = r.child_id
                         JOIN prompt_scores s ON s.prompt_id = r.parent_id AND s.round = r.round
                         WHERE r.strategy = 'soften' AND r.accepted AND r.round = 0""").to_pylist()
    assert made and all(m["bucket"] == "too_hard" and m["root_id"] == m["parent_id"] for m in made)
    assert {json.loads(m["meta"])["level"] for m in made} == {"digits 2,1"}
    drawn = sql(store, """SELECT DISTINCT r.prompt_id FROM rollouts r JOIN prompts p USING (prompt_id)
                          WHERE r.run_id = 'soft' AND r.round = 1 AND p.transform = 'soften'""").to_pylist()
    assert {d["prompt_id"] for d in drawn} == {m["child_id"] for m in made}


def test_a_rung_that_is_the_twin_of_a_held_out_prompt_is_refused(store):
    """42 * 5 steps down to 2 * 5, whose twin 5 * 2 is held out: the rung would train on the evaluation's
    problem, so the ledger refuses it as `held out` (any strategy's child, before `duplicate`)."""
    from tasks.core.ids import prompt_id

    template = "Solve the following multiplication: {}. Give only the result as your final answer."
    rows = []
    for expr, answer in (("42 * 5", "210"), ("5 * 2", "10")):
        text = template.format(expr)
        pid = prompt_id(text, answer, "rg:products")
        rows.append({"prompt_id": pid, "text": text, "answer": answer, "source": "rg:products",
                     "params": json.dumps({"min_digits": 1, "max_digits": 2}), "solution": None, "parent_id": None,
                     "meta": json.dumps({"expression": expr}), "root_id": pid, "transform": "original",
                     "created_at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC)})
    store.commit("seed", {"prompts": pa.Table.from_pylist(rows)})
    pool = pl.DataFrame({"run_id": [RUN] * 2, "round": [0, 0], "prompt_id": [r["prompt_id"] for r in rows],
                         "status": ["active", "heldout"], "level": [None, None]},
                        schema_overrides={"round": pl.Int32, "level": pl.String})
    nxt = _round(store, 0, pool, {rows[0]["prompt_id"]: [0] * 4})  # 42 * 5 steps down to 2 * 5
    made = sql(store, "SELECT accepted, reason, child_id FROM refinements WHERE strategy = 'soften'").to_pylist()
    rung = prompt_id(template.format("2 * 5"), "10", "rg:products")
    assert made == [{"accepted": False, "reason": "held out: the child is a held-out prompt of this run, or its twin",
                     "child_id": rung}]
    assert rung not in nxt["prompt_id"].to_list()  # never in the pool, never in prompts
    assert sql(store, "SELECT count(*) AS n FROM prompts WHERE transform = 'soften'").to_pylist() == [{"n": 0}]
