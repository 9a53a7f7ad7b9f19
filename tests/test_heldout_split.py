"""The held-out split (tasks/core/heldout.py, tasks/pool.py): twins held out together, every pool source entry
represented, seeded and deterministic, "flat" unchanged, and a real run recording each prompt's stratum."""

from collections import Counter, defaultdict

import pytest
from test_eval_dataset import SETS

from flows.config import load_config
from storage.query import sql
from storage.store import Store
from tasks.core.heldout import heldout_roots, stratified_heldout, stratum_name, twin_key
from tasks.core.sources import rg_rows

# the evidence pool's five entries at a small size: three one-digit entries over the same few facts
SOURCES = [("products", {"max_digits": 1}, 120),
           ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+", "-"],
                                 "allow_parentheses": False, "allow_negation": False}, 120),
           ("chain_sum", {"min_terms": 2, "max_terms": 2, "max_digits": 1}, 120),
           ("products", {"min_digits": 2, "max_digits": 2}, 40),
           ("chain_sum", {"min_terms": 3, "max_terms": 4, "min_digits": 2, "max_digits": 2}, 40)]


@pytest.fixture(scope="module")
def pool():
    """(prompt_id, stratum, twin key) of the real generated prompts, the first entry listing a prompt owning it,
    and each prompt's (text, answer)."""
    rows, texts = {}, {}
    for name, params, size in SOURCES:
        for r in rg_rows(name, size, 0, params):
            rows.setdefault(r.prompt_id, (r.prompt_id, stratum_name(f"rg:{name}", params), twin_key(r.text, r.answer)))
            texts[r.prompt_id] = (r.text, r.answer)
    return list(rows.values()), texts


def test_commutative_twins_share_a_key_and_differences_do_not(pool):
    _, texts = pool
    by_text = {t: twin_key(t, a) for t, a in texts.values()}
    plus = [t for t in by_text if t.startswith("Calculate ") and " + " in t and "0" not in t]
    swapped = {t: t.replace("Calculate ", "").rstrip(".").split(" + ") for t in plus}
    pairs = [(t, u) for t in plus for u in plus if t < u and swapped[t] == swapped[u][::-1]]
    assert pairs, "the generated one-digit sums hold no commutative pair"
    assert all(by_text[t] == by_text[u] for t, u in pairs)
    assert twin_key("Calculate 9 - 6.", "3") != twin_key("Calculate 6 - 9.", "-3")
    # the same fact under another source's template is a twin too
    assert twin_key("Calculate 6 + 9.", "15") == twin_key(
        "State the final answer to the following arithmetic problem: 9 + 6 =", "15")


def test_twins_are_held_out_or_trained_together(pool):
    rows, _ = pool
    held = stratified_heldout(rows, 0.25, seed=0)
    sides = defaultdict(set)
    for pid, _, key in rows:
        sides[key].add(pid in held)
    assert max(Counter(k for _, _, k in rows).values()) > 1  # there are twins to keep together
    assert all(len(s) == 1 for s in sides.values()), [k for k, s in sides.items() if len(s) > 1][:3]
    # the flat rule, by contrast, splits twins
    flat = heldout_roots([p for p, _, _ in rows], 0.25, seed=0)
    assert any(len({pid in flat for pid, _, k in rows if k == key}) > 1 for key in sides)


def test_every_stratum_holds_out_about_its_share(pool):
    rows, _ = pool
    held = stratified_heldout(rows, 0.25, seed=0)
    groups, taken = defaultdict(set), defaultdict(set)
    for pid, stratum, key in rows:
        groups[stratum].add(key)
        if pid in held:
            taken[stratum].add(key)
    assert len(groups) == 5
    for stratum, keys in groups.items():
        quota = max(1, round(0.25 * len(keys)))
        # at least its quota; more only through groups it shares with an earlier stratum, and never all
        assert quota <= len(taken[stratum]) < len(keys), (stratum, len(keys), len(taken[stratum]))
        assert len(taken[stratum]) <= quota * 1.5 + 1, (stratum, quota, len(taken[stratum]))
    # a stratum of one group is never held out, and nothing is held out from nothing
    assert stratified_heldout([("a", "s", "k1"), ("b", "t", "k2")], 0.2, 0) in ({"a"}, {"b"})
    assert stratified_heldout([("a", "s", "k1"), ("b", "s", "k1")], 0.5, 0) == set()
    assert stratified_heldout([], 0.5, 0) == set()


def test_the_split_is_seeded_and_ignores_row_order_within_strata(pool):
    rows, _ = pool
    a = stratified_heldout(rows, 0.25, seed=0)
    assert a == stratified_heldout(rows, 0.25, seed=0)
    order = {s: i for i, s in enumerate(dict.fromkeys(r[1] for r in rows))}  # strata keep the config's order
    assert a == stratified_heldout(sorted(rows, key=lambda r: (order[r[1]], r[0][::-1])), 0.25, 0)
    assert a != stratified_heldout(rows, 0.25, seed=1)


def _store_pool(tmp_path, split: str):
    from tasks.pool import PoolConfig, initial_pool

    cfg = PoolConfig(sources=[{"source": f"rg:{n}", "size": s, "params": p} for n, p, s in SOURCES])
    return initial_pool(Store(tmp_path / split), "r", cfg, 0.25, 0, split)


def test_flat_is_the_old_rule_and_records_no_stratum(tmp_path):
    flat = _store_pool(tmp_path, "flat")
    held = set(flat.filter(flat["status"] == "heldout")["prompt_id"])
    assert held == heldout_roots(flat["prompt_id"].to_list(), 0.25, 0)
    assert flat["stratum"].null_count() == flat.height
    strat = _store_pool(tmp_path, "stratified")
    assert strat["stratum"].null_count() == 0 and strat["stratum"].n_unique() == 5
    assert sorted(strat["prompt_id"]) == sorted(flat["prompt_id"])


def test_a_stored_config_without_the_field_keeps_the_flat_split():
    from flows.config import stored_base

    assert load_config(sets=[]).eval.heldout_split == "stratified"
    assert stored_base({"eval": {"heldout_fraction": 0.3}})[0]["eval"]["heldout_split"] == "flat"


def test_a_scripted_run_records_each_heldout_prompts_stratum(prefect_api, tmp_path):
    from flows.curriculum import curriculum

    store = Store(tmp_path / "store")
    cfg = load_config(sets=SETS, run_id="strata", store=store.root, rounds=1)
    curriculum(cfg)
    rows = sql(store, "SELECT stratum, count(*) AS n, count(*) FILTER (WHERE status = 'heldout') AS held "
                      "FROM pool WHERE run_id = 'strata' AND round = 0 GROUP BY stratum ORDER BY stratum").to_pylist()
    names = sorted(stratum_name(s.source, s.params) for s in cfg.pool.sources)
    assert [r["stratum"] for r in rows] == names
    assert all(r["held"] >= 1 and r["held"] < r["n"] for r in rows), rows
    # the evaluation scored exactly those prompts
    n = sql(store, "SELECT n_prompts FROM evals WHERE run_id = 'strata' AND split = 'heldout'").to_pylist()
    assert n and all(e["n_prompts"] == sum(r["held"] for r in rows) for e in n)
