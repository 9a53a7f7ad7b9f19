"""Screening, then top-up (the default dynamic sampling, issue 50 item 2): k_s screening samples per candidate, a
group completed to G only where the screen is mixed or the pass-rate posterior still finds it likely informative,
the rest landing in `discarded_rollouts` (reason `screened_out`) and their freed tokens going to refills; and
dapo_filter's over-sampling factor set from the last round's informative ratio.

The pure decisions are tested on made-up posteriors; the stage and the flow on the scripted policy
(models/scripted.py), whose prompts have every solve rate, with a real store."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from conftest import kill_at_flag, q, round_ctx

from flows.config import load_config
from storage.store import Store
from tasks.core.dapo import SCREENED_OUT, adaptive_oversample, dynamic_sampling
from tasks.core.passrate import p_informative_at, thompson_draws
from tasks.core.screening import (
    MIXED,
    POSTERIOR,
    SCREENED,
    p_group_informative,
    refill_order,
    screen_decisions,
    stratified,
)


# ---- the pure decisions --------------------------------------------------------------------------------------
def test_the_topup_probability_is_the_beta_integral():
    """P(the G - k_s top-ups are not all like the screen) equals the integral over Beta(α, β), by quadrature."""
    from scipy import integrate, stats

    def all_like_the_screen(p: float, a: float, b: float, passed: bool, m: int) -> float:
        return (p if passed else 1 - p) ** m * stats.beta.pdf(p, a, b)

    for a, b, passed, m in [(1.0, 5.0, False, 6), (2.4, 5.6, False, 6), (7.0, 1.5, True, 2), (3.0, 3.0, True, 6)]:
        direct = 1 - integrate.quad(all_like_the_screen, 0, 1, args=(a, b, passed, m))[0]
        got = p_group_informative(np.array([a]), np.array([b]), np.array([passed]), m)[0]
        assert got == pytest.approx(direct, abs=1e-9), (a, b, passed, m)


def test_mixed_is_topped_up_unanimous_by_the_posterior_and_the_rest_screened_out():
    # 0: mixed (whatever its posterior); 1: all failed, alone in a new bin (Beta(1, 5)): P = 6/11 >= 0.5;
    # 2: all failed in a bin that only ever failed (Beta(1, 9)): P = 0.4; 3: all passed in a bin passing 35% of
    # the time (Beta(4.4, 3.6)): likely mixed; 4: all passed in a saturated bin (Beta(12, 1)): screened out
    d = screen_decisions([True, False, False, False, False], [False, False, False, True, True],
                         np.array([1.0, 1.0, 1.0, 4.4, 12.0]), np.array([30.0, 5.0, 9.0, 3.6, 1.0]), 6, 0.5)
    assert [x.why for x in d] == [MIXED, POSTERIOR, SCREENED, POSTERIOR, SCREENED]
    assert [x.topup for x in d] == [True, True, False, True, False]
    assert d[1].p_informative == pytest.approx(1 - 5 / 11) and d[2].p_informative == pytest.approx(0.4)
    # the threshold is the knob: at 0 every screen is topped up, at 1 only the mixed ones
    assert all(x.topup for x in screen_decisions([False] * 3, [False] * 3, np.ones(3), np.full(3, 9.0), 6, 0.0))
    assert not any(x.topup for x in screen_decisions([False] * 3, [True] * 3, np.ones(3), np.ones(3), 6, 1.0))
    with pytest.raises(ValueError, match="threshold must be in"):
        screen_decisions([True], [False], np.ones(1), np.ones(1), 6, 1.5)


def test_refills_go_best_predicted_first_and_the_order_is_keyed():
    ids = [f"p{i}" for i in range(6)]
    alpha = np.array([1.0, 1.0, 30.0, 1.0, 5.0, 1.0])  # p2: nearly always solved; p4: about half
    beta = np.array([30.0, 30.0, 1.0, 30.0, 5.0, 1.0])
    order = refill_order(ids, alpha, beta, seed=0, round=3, group_size=8)
    score = dict(zip(ids, p_informative_at(thompson_draws(ids, alpha, beta, 0, 3), 8)))
    assert [score[i] for i in order] == sorted(score.values(), reverse=True)  # best predicted first
    assert order.index("p4") < min(order.index(i) for i in ("p0", "p1", "p2", "p3"))  # near-certain ones after
    assert order == refill_order(ids, alpha, beta, seed=0, round=3, group_size=8)  # keyed: a resume redraws it
    sub = refill_order(ids[:4], alpha[:4], beta[:4], seed=0, round=3, group_size=8)
    assert sub == [i for i in order if i in sub]  # a prompt's draw does not depend on who stands beside it


def _within_one_of_shares(prefix: list[str], bin_of: dict[str, str], shares: dict[str, float]) -> bool:
    return all(abs(sum(bin_of[i] == b for i in prefix) - len(prefix) * share) < 1 + 1e-9 for b, share in shares.items())


def test_stratified_refills_hold_each_bin_at_its_share_in_every_prefix_best_first_inside():
    rng = np.random.default_rng(0)
    ids = [f"p{i:02d}" for i in range(17)]
    bins = ["a"] * 10 + ["b"] * 5 + ["c"] * 2
    alpha, beta = rng.uniform(0.5, 20, 17), rng.uniform(0.5, 20, 17)
    plain = refill_order(ids, alpha, beta, seed=1, round=2, group_size=8)
    order = refill_order(ids, alpha, beta, seed=1, round=2, group_size=8, bins=bins)
    bin_of = dict(zip(ids, bins))
    assert sorted(order) == ids
    shares = {b: bins.count(b) / len(bins) for b in set(bins)}
    assert all(_within_one_of_shares(order[:n], bin_of, shares) for n in range(len(order) + 1))
    for b in shares:  # inside a bin, the plain order: best predicted first
        assert [i for i in order if bin_of[i] == b] == [i for i in plain if bin_of[i] == b]
    assert order == refill_order(ids, alpha, beta, seed=1, round=2, group_size=8, bins=bins)  # keyed
    assert plain[:6] != order[:6]  # the plain order front-loads some bins: here it differs
    assert stratified([], {}) == []
    for trial in range(200):  # K bins of random sizes: every prefix within the documented bound of the shares
        k = int(rng.integers(2, 7))
        sizes = rng.integers(1, 12, k)
        many = [f"{b}-{j}" for b in range(k) for j in range(sizes[b])]
        rng.shuffle(many)
        of = {i: i.split("-")[0] for i in many}
        out, bound = stratified(many, of), (1.0 - 2e-9 if k <= 3 else (k - 1) / 2)  # under one for up to 3 bins
        assert [i for i in out if of[i] == "0"] == [i for i in many if of[i] == "0"]
        for n in range(len(out) + 1):
            assert all(abs(sum(of[i] == str(b) for i in out[:n]) - n * sizes[b] / len(many)) < bound + 1e-9
                       for b in range(k)), (trial, n)
    with pytest.raises(ValueError, match="17 candidates need as many bins, got 2"):
        refill_order(ids, alpha, beta, seed=1, round=2, group_size=8, bins=["a", "b"])


def test_the_loop_names_screened_out_groups():
    """dynamic_sampling with a `verdict`: a screened-out group is discarded as such even if its rewards differ."""
    groups = {0: ("topped", [0.0, 1.0]), 1: ("screened", [0.0, 0.0]), 2: ("topped", [1.0, 0.0])}
    out = dynamic_sampling([0, 1, 2], batch=2, oversample=1.0, max_batches=3,
                           generate=lambda items, k: [groups[i] for i in items], rewards=lambda g: g[1],
                           verdict=lambda g: SCREENED_OUT if g[0] == "screened" else None)
    assert [d.item for d in out.kept] == [0, 2]
    assert [(d.item, d.reason) for d in out.discarded] == [(1, "screened_out")]


def test_dapo_factor_is_one_over_the_last_informative_ratio_capped_at_three():
    assert adaptive_oversample(None, 2.5) == 2.5  # round 0: the configured factor
    assert adaptive_oversample(0.8, 3.0) == pytest.approx(1.25) and adaptive_oversample(0.2, 3.0) == 3.0
    assert adaptive_oversample(0.0, 3.0) == 3.0 and adaptive_oversample(1.0, 3.0) == 1.0


# ---- the stage, on the scripted policy -----------------------------------------------------------------------
def scripted(*extra: str) -> list[str]:
    return ["model.policy=tiny-random", "model.backend=scripted", "model.dtype=fp32", "rollout.group_size=4",
            "rollout.screen_samples=2", "rollout.max_new_tokens=40", "rollout.fewshot_k=0",
            "rollout.lope_prefixes=0", "select.selector=uniform", "select.batch_size=6", "select.embedder=hashing",
            'pool.sources=[{"source": "rg:products", "size": 40, "params": {"max_digits": 1}}]', *extra]


def _select_and_collect(store: Store, run: str, sets: list[str], round: int = 0) -> dict:
    from tasks.collect import collect_task
    from tasks.pool import pool_task
    from tasks.select import select_task

    cfg = load_config(sets=sets)
    pool_task.fn(round_ctx(store, run, round), cfg.pool)
    select_task.fn(round_ctx(store, run, round, model=cfg.model), cfg.select, cfg.rollout.include_reserve)
    return collect_task.fn(round_ctx(store, run, round, model=cfg.model), cfg.rollout, cfg.reward, cfg.select,
                           use_selection=True)


ROWS = "SELECT round, prompt_id, sample_idx, completion, reward, n_tokens FROM {} ORDER BY ALL"


def test_a_topped_up_group_is_its_screen_then_fresh_keyed_samples(store, tmp_path):
    """Every kept group has exactly G rows, sample_idx 0..G-1: rows 0..k_s-1 are what the backend draws with the
    round's row seeds, rows k_s.. what it draws with the top-up stride's; a rerun lands the same rows."""
    from models.backend import Sampling
    from models.registry import load_backend
    from tasks.core.seeds import round_seed, row_seeds
    from tasks.sampling.screening import TOPUP_SEED_STRIDE

    out = _select_and_collect(store, "m", scripted())
    s = out["screening"]
    # B = 6; a mixed screen is topped up and kept even past B (its group is informative for sure), so the
    # batch may hold more; no surplus screen is mixed
    assert s["kept"] == out["prompts"] >= 6 and s["topped_up_mixed"] > 0
    left = q(store, """SELECT prompt_id FROM discarded_rollouts WHERE run_id = 'm' AND reason = 'surplus'
                       GROUP BY prompt_id HAVING count(DISTINCT reward) > 1""")
    assert left == []
    groups = q(store, """SELECT prompt_id, any_value(prompt_text) AS text, list(sample_idx ORDER BY sample_idx) AS idx,
                                list(completion ORDER BY sample_idx) AS texts, min(reward) AS lo, max(reward) AS hi
                         FROM rollouts WHERE run_id = 'm' GROUP BY prompt_id""")
    assert len(groups) == s["kept"] and all(g["idx"] == [0, 1, 2, 3] and g["lo"] < g["hi"] for g in groups)
    past = len(groups) - 6
    assert past >= 0 and s["topped_up_mixed"] >= past  # only mixed screens run past B
    cfg = load_config(sets=scripted())
    backend = load_backend("tiny-random", "scripted", "cpu", "fp32", cfg.model.batch_size)
    seed = round_seed(cfg.rollout.seed, 0)
    for g in groups:
        how = Sampling(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.max_new_tokens, seed)
        screen = backend.generate([g["text"]], 2, how, row_seeds=row_seeds(seed, [g["prompt_id"]]))[0]
        top = seed + TOPUP_SEED_STRIDE
        more = backend.generate([g["text"]], 2, Sampling(how.temperature, how.top_p, how.max_new_tokens, top),
                                row_seeds=row_seeds(top, [g["prompt_id"]]))[0]
        assert g["texts"] == [c.text for c in screen + more]
    # tokens: what the round generated (screens under `screen`, top-ups under `rollout`) is exactly what landed
    spent = {r["purpose"]: r["tokens"] for r in q(store, "SELECT purpose, tokens FROM generated_tokens "
                                                            "WHERE run_id = 'm' AND stage = 'collect'")}
    landed = q(store, "SELECT (SELECT sum(n_tokens) FROM rollouts WHERE run_id = 'm') AS kept, "
                      "(SELECT sum(n_tokens) FROM discarded_rollouts WHERE run_id = 'm') AS gone")[0]
    assert spent == {"screen": s["screen_tokens"], "rollout": s["topup_tokens"]}
    assert sum(spent.values()) == landed["kept"] + landed["gone"] == out["tokens"]
    # selections name every prompt generated for; each group is in exactly one table
    selected = [r["prompt_id"] for r in q(store, "SELECT prompt_id FROM selections WHERE run_id = 'm'")]
    gone = {r["prompt_id"] for r in q(store, "SELECT DISTINCT prompt_id FROM discarded_rollouts WHERE run_id = 'm'")}
    assert len(selected) == len(set(selected)) == s["screened"] == len(groups) + len(gone)
    assert set(selected) == {g["prompt_id"] for g in groups} | gone
    # a rerun of the round in another store lands the same rows
    again = Store(tmp_path / "again")
    _select_and_collect(again, "m", scripted())
    for table in ("rollouts", "discarded_rollouts"):
        assert q(again, ROWS.format(table)) == q(store, ROWS.format(table))


def test_unanimous_screens_the_posterior_gives_up_on_land_screened_out(store, tmp_path):
    """Questions the scripted policy never solves, all in one bin: after the batch's screens the bin has only
    failed, so no screen is topped up; each prompt's k_s rows land in discarded_rollouts as screened_out, the
    candidates run out, no rollout is kept, and every screening token is charged."""
    src = tmp_path / "never.jsonl"
    words = ["one", "two", "three", "four", "five", "six", "seven", "eight"]  # the script guesses 0: never right
    src.write_text("".join(json.dumps({"question": f"Name the number {w}.", "answer": str(i + 1)}) + "\n"
                           for i, w in enumerate(words)))
    out = _select_and_collect(store, "e", scripted(f'pool.sources=[{{"source": "{src}"}}]', "rollout.group_size=8"))
    s = out["screening"]
    assert (s["kept"], s["screened_out"], s["topped_up_posterior"], s["topup_tokens"], s["exhausted"]) == \
        (0, 8, 0, 0, True)
    assert q(store, "SELECT count(*) AS n FROM rollouts WHERE run_id = 'e'") == [{"n": 0}]
    rows = q(store, """SELECT reason, count(DISTINCT prompt_id) AS groups, count(*) AS n, max(sample_idx) AS top,
                              sum(n_tokens) AS tokens FROM discarded_rollouts WHERE run_id = 'e' GROUP BY reason""")
    assert rows == [{"reason": "screened_out", "groups": 8, "n": 16, "top": 1, "tokens": s["screen_tokens"]}]
    assert out["tokens"] == s["screen_tokens"] > 0
    # scored on their screens: too_hard with n = k_s, so EPS selection stops treating them as never scored and
    # refinement and shaping see them
    from tasks.score import score_task

    cfg = load_config(sets=scripted())
    summary = score_task.fn(round_ctx(store, "e", 0), cfg.utility)
    assert summary["screened_out"] == 8 and summary["buckets"] == {"too_hard": 8}
    assert q(store, "SELECT bucket, n, count(*) AS groups FROM prompt_scores WHERE run_id = 'e' GROUP BY ALL") == \
        [{"bucket": "too_hard", "n": 2, "groups": 8}]


def _refills(store: Store, run: str, round: int) -> tuple[list[str], set[str]]:
    """(the round's refill prompts, the candidates its selection left), from the store."""
    picks = q(store, f"SELECT prompt_id, reason FROM selections WHERE run_id = '{run}' AND round = {round}")
    first = {r["prompt_id"] for r in picks if "refill" not in r["reason"]}
    active = {r["prompt_id"] for r in q(store, f"SELECT prompt_id FROM pool WHERE run_id = '{run}' AND "
                                                f"round = {round} AND status = 'active'")}
    return [r["prompt_id"] for r in picks if "refill" in r["reason"]], active - first


@pytest.mark.parametrize("order", ["informative", "stratified"])
def test_stratified_refills_land_each_bin_at_its_share_of_the_rest(store, tmp_path, order):
    """Round 1, after a round 0 that showed one bin (questions the script never answers) failing: informative
    refills put that bin last; stratified ones screen each pass-rate bin within one prompt of its share of the
    candidates the selection left (the refills are a prefix of the stratified queue), counted from the store."""
    from tasks.selectors.thompson import bins_of

    never = tmp_path / "never.jsonl"
    never.write_text("".join(json.dumps({"question": f"Spell the number {i} in words.", "answer": str(i + 1)}) + "\n"
                             for i in range(30)))
    sets = scripted(f'pool.sources=[{{"source": "rg:products", "size": 40, "params": {{"max_digits": 1}}}}, '
                    f'{{"source": "{never}"}}]', f"rollout.screen_refill={order}", "select.batch_size=8")
    _select_and_collect(store, "st", sets, 0)
    out = _select_and_collect(store, "st", sets, 1)
    assert out["screening"]["generation_batches"] > 1
    refills, rest = _refills(store, "st", 1)
    bin_of = dict(bins_of(store, rest).unique("prompt_id").filter(pl.col("prompt_id").is_in(list(rest))).iter_rows())
    shares = {b: sum(v == b for v in bin_of.values()) / len(rest) for b in set(bin_of.values())}
    assert len(shares) == 2 and len(refills) >= 4 and set(refills) <= rest
    failing = next(b for b in shares if "never" in b)
    share = sum(bin_of[i] == failing for i in refills) / len(refills)
    if order == "stratified":
        assert _within_one_of_shares(refills, bin_of, shares)
    else:  # the failing bin is predicted uninformative: screened after the rest, if at all
        assert share < shares[failing] / 2


def test_screening_off_samples_g_at_once(store):
    out = _select_and_collect(store, "o", scripted("rollout.screen_samples=0"))
    assert "screening" not in out and out["rollouts"] == 6 * 4
    assert q(store, "SELECT DISTINCT purpose FROM generated_tokens WHERE run_id = 'o'") == [{"purpose": "rollout"}]


def test_a_run_stored_before_screening_resumes_without_it():
    """A stored config without rollout.screen_samples ran G at once: its resume keeps it off, whether resumed from
    the CLI (load_config over the stored config) or from a form that passes today's defaults (keep_stored)."""
    from flows.config import RunConfig
    from flows.curriculum import keep_stored

    stored = RunConfig().model_dump(mode="json")
    del stored["rollout"]["screen_samples"]
    assert RunConfig().rollout.screen_samples == 2  # the default for new runs
    assert load_config(stored=stored).rollout.screen_samples == 0
    assert keep_stored(RunConfig(), stored).rollout.screen_samples == 0
    assert load_config(sets=["rollout.screen_samples=3"], stored=stored).rollout.screen_samples == 3


RUN = """
import sys
sys.path.insert(0, "tests")
from test_screening import _select_and_collect, scripted
from storage.store import Store
_select_and_collect(Store(sys.argv[1]), "k", scripted())
"""


def test_sigkill_mid_screening_then_rerun_lands_the_same_rows(store, tmp_path):
    """SIGKILL the process mid-collection (mid-screening); nothing of the stage landed; the rerun lands exactly
    the rows and token counts of an uninterrupted round."""
    flag = tmp_path / "reached"
    env = {**os.environ, "REFINERY_FAULT": "collect:mid", "REFINERY_FAULT_FLAG": str(flag)}
    proc = subprocess.Popen([sys.executable, "-c", RUN, store.root], env=env,
                            cwd=os.path.dirname(os.path.dirname(__file__)))
    kill_at_flag(proc, flag, "collect:mid")
    assert store.landed("k", 0, "select") and not store.landed("k", 0, "collect")
    from tasks.collect import collect_task

    cfg = load_config(sets=scripted())
    collect_task.fn(round_ctx(store, "k", 0, model=cfg.model), cfg.rollout, cfg.reward, cfg.select, use_selection=True)
    clean = Store(tmp_path / "clean")
    _select_and_collect(clean, "k", scripted())
    for table in ("rollouts", "discarded_rollouts"):
        assert q(store, ROWS.format(table)) == q(clean, ROWS.format(table))
    ledger = "SELECT round, stage, purpose, calls, completions, tokens FROM generated_tokens ORDER BY ALL"
    assert q(store, ledger) == q(clean, ledger)


def test_dapo_filter_oversamples_by_one_over_last_rounds_informative_ratio(store):
    """Round 0 over-samples by dapo_oversample; round 1 by 1 / round 0's informative ratio (capped at 3), and the
    select and collect summaries record the same factor."""
    from tasks.score import UtilityConfig, score_task

    sets = scripted("select.selector=dapo_filter", "select.dapo_oversample=1.0")
    first = _select_and_collect(store, "d", sets)["dapo"]
    assert first["oversample"] == 1.0
    score_task.fn(round_ctx(store, "d", 0), UtilityConfig())
    varied = first["kept"] + first["surplus"]
    ratio = varied / first["groups_generated"]
    assert 0 < ratio < 1
    from tasks.pool import pool_task
    from tasks.select import select_task

    cfg = load_config(sets=sets)
    pool_task.fn(round_ctx(store, "d", 1), cfg.pool)
    picked = select_task.fn(round_ctx(store, "d", 1, model=cfg.model), cfg.select, False)
    factor = min(3.0, 1 / ratio)
    assert picked["oversample"] == pytest.approx(factor) and picked["last_informative_ratio"] == pytest.approx(ratio)
    assert q(store, "SELECT count(*) AS n FROM selections WHERE run_id = 'd' AND round = 1 AND reason LIKE "
                    "'%batch 1'") == [{"n": math.ceil(factor * 6 - 1e-9)}]
    from tasks.collect import collect_task

    second = collect_task.fn(round_ctx(store, "d", 1, model=cfg.model), cfg.rollout, cfg.reward, cfg.select,
                             use_selection=True)
    assert second["dapo"]["oversample"] == pytest.approx(factor)
    assert "screening" not in second  # dapo_filter generates full groups: no screening under it
    assert q(store, "SELECT DISTINCT purpose FROM generated_tokens WHERE run_id = 'd'") == [{"purpose": "rollout"}]


# ---- the flow ------------------------------------------------------------------------------------------------
def test_two_screened_rounds_land_their_rows_and_tokens(prefect_api, tmp_path):
    """Two rounds of the curriculum flow with screening on (thompson selection) on the scripted policy: every
    kept group has G rows; per round, the collect tokens in generated_tokens (screen + rollout) equal the n_tokens
    of its rollouts plus its discarded_rollouts; the governor's baseline is measured over both purposes."""
    from flows.curriculum import curriculum
    from tasks.govern import measures

    store = Store(tmp_path / "store")
    cfg = load_config(sets=scripted("select.selector=thompson", "refine.strategies=[]", "shape.enabled=false",
                                    "eval.enabled=false", "train.kl_coef=0", "train.micro_batch=24"),
                      run_id="scr", store=store.root, rounds=2)
    out = curriculum(cfg)
    collected = {s["round"]: s["screening"] for s in out["stages"] if s["stage"] == "collect"}
    assert sorted(collected) == [0, 1] and all(c["kept"] > 0 for c in collected.values())
    sizes = q(store, "SELECT DISTINCT count(*) AS n FROM rollouts WHERE run_id = 'scr' GROUP BY round, prompt_id")
    assert sizes == [{"n": 4}]
    per_round = q(store, """
        SELECT t.round, t.tokens, k.tokens AS kept, coalesce(d.tokens, 0) AS gone FROM
          (SELECT round, sum(tokens) AS tokens FROM generated_tokens WHERE run_id = 'scr' AND stage = 'collect'
           GROUP BY round) t
          JOIN (SELECT round, sum(n_tokens) AS tokens FROM rollouts WHERE run_id = 'scr' GROUP BY round) k USING (round)
          LEFT JOIN (SELECT round, sum(n_tokens) AS tokens FROM discarded_rollouts WHERE run_id = 'scr'
                     GROUP BY round) d USING (round) ORDER BY round""")
    assert [r["round"] for r in per_round] == [0, 1]
    for r in per_round:
        c = collected[r["round"]]
        assert r["tokens"] == r["kept"] + r["gone"] == c["screen_tokens"] + c["topup_tokens"], r
    baseline = measures(store, "scr", 2)["rollout"]
    assert [baseline[r].tokens for r in (0, 1)] == [r["tokens"] for r in per_round]
    # the pass-rate model's prediction for every prompt screened lands before the round generated anything
    # (the posterior of the earlier rounds' groups), beside the thompson selector's own predictions
    from tasks.core.passrate import pass_counts, posterior
    from tasks.selectors.thompson import PRIOR_STRENGTH, bins_of

    made = q(store, "SELECT selector, round, prompt_id, predicted_pass_rate AS p, predicted_informative AS pi "
                    "FROM predictions WHERE run_id = 'scr' ORDER BY selector, round, prompt_id")
    screened = [r for r in made if r["selector"] == "screening"]
    assert {r["selector"] for r in made} == {"screening", "thompson"}
    drawn = q(store, """SELECT DISTINCT round, prompt_id FROM (SELECT round, prompt_id FROM rollouts WHERE run_id = 'scr'
                        UNION ALL SELECT round, prompt_id FROM discarded_rollouts WHERE run_id = 'scr')
                        ORDER BY round, prompt_id""")
    assert [(r["round"], r["prompt_id"]) for r in screened] == [(d["round"], d["prompt_id"]) for d in drawn]
    assert {r["p"] for r in screened if r["round"] == 0} == {0.5}  # nothing generated before round 0
    before = pl.DataFrame(q(store, """
        SELECT prompt_id, reward, correct, augmentation FROM rollouts WHERE run_id = 'scr' AND round = 0 UNION ALL
        SELECT prompt_id, reward, correct, augmentation FROM discarded_rollouts WHERE run_id = 'scr' AND round = 0"""),
        schema={"prompt_id": pl.String, "reward": pl.Float64, "correct": pl.Boolean, "augmentation": pl.String})
    later = [r for r in screened if r["round"] == 1]
    want = posterior(bins_of(store, {r["prompt_id"] for r in later} | set(before["prompt_id"])), pass_counts(before),
                     PRIOR_STRENGTH)
    mean = dict(zip(want["prompt_id"], (want["alpha"] / (want["alpha"] + want["beta"])).to_list()))
    assert all(abs(r["p"] - mean[r["prompt_id"]]) < 1e-12 for r in later) and len({r["p"] for r in later}) > 1


def test_the_screening_counterfactual_replays_each_top_up_rule_on_full_groups():
    """benchmarks/screening_ceiling.py on five hand-made groups of G = 4 (screen: the first 2 samples), every
    figure computed by hand: a mixed screen, two all-correct ones (one group mixed after), two failing ones (one
    mixed after)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ceiling", Path(__file__).parent.parent / "benchmarks" /
                                                  "screening_ceiling.py")
    ceiling = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ceiling)
    groups = {"g1": ([1, 0, 1, 1], 10), "g2": ([1, 1, 1, 0], 5), "g3": ([1, 1, 1, 1], 5), "g4": ([0, 0, 0, 0], 20),
              "g5": ([0, 0, 1, 0], 20)}
    rows = pl.DataFrame([{"stratum": "a", "run_id": "r", "round": 0, "prompt_id": p, "sample_idx": i,
                          "reward": float(r), "n_tokens": t} for p, (rs, t) in groups.items() for i, r in enumerate(rs)])
    kinds = ceiling.screen_kinds(rows, 2).sort("prompt_id")
    assert kinds["kind"].to_list() == ["mixed", "pass", "pass", "fail", "fail"]
    assert kinds["informative"].to_list() == [True, True, False, False, True]
    got = {r["rule"]: (r["informative"], r["tokens"]) for r in ceiling.counterfactual(kinds).iter_rows(named=True)}
    # best: the screens and the mixed top-up cost 140 tokens for 1 informative group; the all-correct screens'
    # top-ups add 20 tokens for 1, the failing ones' 80 for 1: the minimal ratio, 80, takes only the former (the
    # latter ties it: 240 / 3)
    assert got == {"plain": (3, 240), "mixed_only": (1, 140), "and_pass": (2, 160), "and_fail": (2, 220),
                   "best": (2, 160), "oracle": (3, 140)}
    never = pl.DataFrame([{"stratum": "b", "run_id": "r", "round": 0, "prompt_id": "h", "sample_idx": i,
                           "reward": 0.0, "n_tokens": 30} for i in range(4)])  # a stratum never informative
    both = ceiling.counterfactual(ceiling.screen_kinds(pl.concat([rows, never]), 2))
    assert both.filter(pl.col("stratum") == "b").select("rule", "informative", "tokens").rows() == [
        ("and_fail", 0, 120), ("and_pass", 0, 60), ("best", 0, 60), ("mixed_only", 0, 60), ("oracle", 0, 0),
        ("plain", 0, 120)]  # never topped up by `best`, and a row for the oracle that draws nothing there
    assert ceiling.table(both)[1]["informative_share_oracle_1"] == 0.0
    lines, figures = ceiling.table(ceiling.counterfactual(kinds))
    assert figures["ratio_oracle"] == round(80 / (140 / 3), 4) and figures["ratio_mixed_only"] == round(80 / 140, 4)
    with pytest.raises(ValueError, match="needs full groups of one size above --screen-samples 4"):
        ceiling.screen_kinds(rows, 4)


def test_prior_calibration_reads_a_store_holding_the_same_run_twice_as_a_perfect_prediction(tmp_path):
    """benchmarks/prior_calibration.py's predictors of an informative group: in a copy of the golden scripted
    store with a twin of its run landed beside it, the other run's groups of each prompt predict every group of
    rounds >= 1 exactly (AUC 1), while the bin posterior and the k-NN, which see only the run's own earlier
    rounds, read the same with the twin as without it."""
    import importlib.util
    import json as json_
    import shutil

    from storage.query import scan

    root = Path(__file__).parent.parent
    shutil.copytree(root / "tests" / "data" / "golden" / "scripted", tmp_path / "s")
    store = Store(tmp_path / "s")
    rows = scan(store, "rollouts").filter(pl.col("run_id") == "scripted").collect()
    for (r,), part in rows.group_by("round"):
        store.commit("twin-collect", {"rollouts": part.with_columns(pl.lit("twin").alias("run_id")).to_arrow()},
                     run_id="twin", round=r)
    spec = importlib.util.spec_from_file_location("pc", root / "benchmarks" / "prior_calibration.py")
    pc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pc)
    out = tmp_path / "pc.json"
    assert pc.main(["--store", str(tmp_path / "s"), "--runs", "%", "--json", str(out)]) == 0
    figures = json_.loads(out.read_text())
    assert figures["runs"] == ["scripted", "twin"]
    auc = figures["all"]["auc"]
    assert auc["groups"] == 2 * figures["per_run"]["scripted"]["groups"] and 0 < auc["informative_rate"] < 1
    assert auc["auc_other_runs"] == 1.0
    alone = pc.predictor_auc(store, pc.replay(store, "scripted", 2), 10)
    assert "auc_other_runs" not in alone  # only the runs matched count as the store's other runs
    assert (alone["auc_bin"], alone["auc_knn"]) == (auc["auc_bin"], auc["auc_knn"])


def test_a_stored_config_says_whether_its_run_screened():
    """tasks/reporting/page.py `screened_samples` reads k_s off a stored config by `screening_applies`' rule."""
    from tasks.reporting.page import screened_samples

    def stored(ks, selector="kmeans", g=8):
        return {"rollout": {"screen_samples": ks, "group_size": g}, "select": {"selector": selector}}

    assert screened_samples(stored(2)) == 2 and screened_samples(stored(3, "uniform")) == 3
    assert screened_samples({}) == 0  # stored before screening existed: G at once
    assert [screened_samples(c) for c in (stored(8), stored(0), stored(2, "dapo_filter"), stored(2, "all"),
                                          stored(2, "no-such-selector"))] == [0, 0, 0, 0, 0]
