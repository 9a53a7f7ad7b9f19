"""The guessing correction of mcq rungs (issue 50 item 6): promotion reads (r - 1/k) / (1 - 1/k), clipped at 0, on
a rung of k options, so a rung answered near chance is not promoted by luck; other rungs read the raw mean."""

import datetime as dt
import json

import polars as pl
import pyarrow as pa
import pytest
from conftest import round_ctx

from flows.config import RefineConfig
from storage.query import sql
from tasks.core.eps import eps_scores
from tasks.core.ids import prompt_id
from tasks.refine import refine
from tasks.strategies.base import Parent
from tasks.strategies.ladder import chance_corrected, make_cloze, make_mcq, promotion_rate

SOURCE = "rg:products"


def _original(a: int, b: int) -> dict:
    text, answer = f"Solve the following multiplication: {a} * {b}.", str(a * b)
    pid = prompt_id(text, answer, SOURCE)
    return {"prompt_id": pid, "text": text, "answer": answer, "source": SOURCE, "root_id": pid,
            "transform": "original", "params": json.dumps({"max_digits": 2}), "meta": "{}", "parent_id": None,
            "solution": None}


def _mcq(root: dict, k: int) -> dict:
    text, options, _ = make_mcq(root["prompt_id"], root["text"], root["answer"], k)
    level = f"mcq{k}"
    return dict(root, prompt_id=prompt_id(text, root["answer"], SOURCE), text=text, transform=level,
                parent_id=root["prompt_id"], meta=json.dumps({"options": options, "level": level}))


def _cloze(root: dict) -> dict:
    text = make_cloze(root["prompt_id"], root["text"], root["answer"])
    return dict(root, prompt_id=prompt_id(text, root["answer"], SOURCE), text=text, transform="cloze",
                parent_id=root["prompt_id"], meta=json.dumps({"level": "cloze"}))


def _land(store, prompts: list[dict], solved: dict[str, int], g: int = 8) -> None:
    """Prompts, and round 0 of run 'a': `solved[prompt_id]` of g own samples correct, the pool, the scores."""
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    store.commit("seed", {"prompts": pa.Table.from_pylist([dict(p, created_at=now) for p in prompts])})
    text = {p["prompt_id"]: p["text"] for p in prompts}
    ro = [{"run_id": "a", "round": 0, "policy_version": 0, "prompt_id": pid, "sample_idx": j,
           "prompt_text": text[pid], "completion": f"try {j}", "reward": float(j < k), "correct": j < k,
           "n_tokens": 3, "mean_logprob": -1.0, "finish_reason": "stop"} for pid, k in solved.items() for j in range(g)]
    table = pa.Table.from_pylist(ro)
    store.commit("collect", {"rollouts": table}, run_id="a", round=0)
    ids = [p["prompt_id"] for p in prompts]
    store.commit("pool", {"pool": pa.table({"run_id": ["a"] * len(ids), "round": [0] * len(ids), "prompt_id": ids,
                                            "status": ["active"] * len(ids)})}, run_id="a", round=0)
    store.commit("score", {"prompt_scores": eps_scores(pl.from_arrow(table)).to_arrow()}, run_id="a", round=0)


def test_chance_corrected_is_zero_at_chance_and_one_at_one():
    for k in (4, 10):
        assert chance_corrected(1 / k, k) == 0.0 and chance_corrected(1.0, k) == pytest.approx(1.0)
        assert chance_corrected(0.0, k) == 0.0  # clipped, never negative
    assert chance_corrected(0.625, 4) == pytest.approx(0.5)
    assert chance_corrected(0.55, 10) == pytest.approx(0.5)


def test_promotion_rate_reads_the_stored_options_else_the_rung_size():
    root = _original(17, 23)
    mcq4 = _mcq(root, 4)
    assert promotion_rate(Parent(mcq4, root, "informative", 0.75)) == pytest.approx(2 / 3)
    bare = dict(mcq4, meta=json.dumps({"level": "mcq10"}), transform="mcq10")  # no options stored: k = 10
    assert promotion_rate(Parent(bare, root, "informative", 0.55)) == pytest.approx(0.5)
    assert promotion_rate(Parent(_cloze(root), root, "informative", 0.6)) == 0.6  # not multiple choice
    assert promotion_rate(Parent(root, root, "informative", 0.6)) == 0.6


def test_a_rung_near_chance_is_not_promoted_one_well_above_it_is(store):
    """mcq4 at 5/8 (raw 0.625 > 0.5, the old rule promoted it; corrected 0.5) and at 3/8 (chance is 2/8) stay;
    mcq4 at 7/8 (corrected 0.83) and mcq10 at 5/8 (corrected 0.58) are promoted; a cloze rung at 5/8 reads the
    raw mean and is promoted."""
    roots = [_original(a, b) for a, b in ((17, 23), (19, 31), (27, 43), (29, 37), (41, 13))]
    rungs = {"mcq4_lucky": _mcq(roots[0], 4), "mcq4_chance": _mcq(roots[1], 4), "mcq4_solved": _mcq(roots[2], 4),
             "mcq10_solved": _mcq(roots[3], 10), "cloze_solved": _cloze(roots[4])}
    solved = {"mcq4_lucky": 5, "mcq4_chance": 3, "mcq4_solved": 7, "mcq10_solved": 5, "cloze_solved": 5}
    _land(store, roots + list(rungs.values()), {rungs[n]["prompt_id"]: k for n, k in solved.items()})
    refine(round_ctx(store, "a"), store, RefineConfig(strategies=["ladder"]), None)
    name = {r["prompt_id"]: n for n, r in rungs.items()}
    got = sql(store, "SELECT parent_id FROM refinements WHERE strategy = 'promote'").column("parent_id").to_pylist()
    assert sorted(name[p] for p in got) == ["cloze_solved", "mcq10_solved", "mcq4_solved"]
