import json
import math

import polars as pl
import pytest
from conftest import round_ctx

from storage.query import scan
from tasks.core.eps import eps_scores
from tasks.core.pool_rules import next_pool

# docs/algorithms.md §1: EPS for G = 8 binary rewards with k successes
BETA_TABLE = {
    0.25: [0, .761, .698, .595, .482, .364, .244, .122, 0],
    0.5: [0, .389, .461, .441, .381, .300, .207, .106, 0],
    1.0: [0, .155, .225, .245, .231, .194, .141, .075, 0],
}


def _groups(rewards: dict[str, list[float]], round: int = 0) -> pl.DataFrame:
    rows = [{"run_id": "r", "round": round, "policy_version": 0, "prompt_id": p, "reward": float(x)}
            for p, rs in rewards.items() for x in rs]
    return pl.DataFrame(rows)


@pytest.mark.parametrize("beta", sorted(BETA_TABLE))
def test_eps_reproduces_the_beta_table(beta):
    df = _groups({f"k{k}": [1.0] * k + [0.0] * (8 - k) for k in range(9)})
    got = eps_scores(df, beta=beta).sort("prompt_id")["eps"].to_list()
    assert [round(x, 3) for x in got] == BETA_TABLE[beta]


def test_eps_matches_the_formula_on_graded_rewards():
    rs = [0.0, 0.1, 0.5, 0.5, 0.9, 1.0]
    w = [math.exp(r / 0.5) for r in rs]
    expected = sum(wi * r for wi, r in zip(w, rs)) / sum(w) - sum(rs) / len(rs)
    assert eps_scores(_groups({"p": rs}))["eps"][0] == pytest.approx(expected, rel=1e-12)


def test_eps_is_stable_for_tiny_beta():
    got = eps_scores(_groups({"p": [1.0, 0.0, 0.0, 0.0]}), beta=1e-4)
    assert got["eps"][0] == pytest.approx(0.75)


def test_buckets_on_constructed_groups():
    got = dict(eps_scores(_groups({
        "mixed": [1, 0, 0, 1, 0, 0, 0, 0],
        "all_pass": [1] * 8,
        "all_fail": [0] * 8,
        "constant_partial": [0.5] * 8,  # partial credit, no variance: a mean-only filter would keep it
        "graded": [0.2, 0.4, 0.2, 0.4, 0.2, 0.4, 0.2, 0.4],
    })).select("prompt_id", "bucket").iter_rows())
    assert got == {"mixed": "informative", "all_pass": "saturated", "all_fail": "too_hard",
                   "constant_partial": "flat", "graded": "informative"}


def test_tau_demotes_low_utility_groups_to_flat():
    got = eps_scores(_groups({"p": [1, 1, 1, 1, 1, 1, 1, 0]}), tau=0.2)
    assert got["bucket"][0] == "flat" and 0 < got["eps"][0] < 0.2


def test_constant_groups_have_exactly_zero_eps_and_std():
    got = eps_scores(_groups({"a": [0.3] * 8, "b": [1.0] * 8}))
    assert got["eps"].to_list() == [0.0, 0.0] and got["std_reward"].to_list() == [0.0, 0.0]


def test_pool_moves_non_informative_originals_to_reserve_and_reactivates():
    pool = pl.DataFrame({"run_id": ["r"] * 5, "round": [0] * 5, "prompt_id": list("abcde"),
                         "status": ["active", "active", "reserve", "reserve", "active"], "level": [None] * 5},
                        schema_overrides={"level": pl.String})
    scores = pl.DataFrame({"prompt_id": list("abcde"),
                           "bucket": ["informative", "too_hard", "informative", "saturated", "flat"]})
    prompts = pl.DataFrame({"prompt_id": list("abcde"),
                            "transform": ["original", "original", "original", "original", "mcq4"]})
    nxt = next_pool(pool, scores, prompts, round=1)
    assert dict(nxt.select("prompt_id", "status").iter_rows()) == {
        "a": "active", "b": "reserve", "c": "active", "d": "reserve", "e": "active"}
    assert set(nxt["round"]) == {1} and set(nxt["run_id"]) == {"r"}


# ---- utility from the policy's own samples (issue 12 item 2) -----------------------------------------------
# A LoPE-rescued group: the policy got 0/G, and correct resamples under Lorem prefixes replaced up to G - 1 of
# its failures. The replacements train the policy; EPS, buckets, the pool, promotion and shaping read only the
# policy's own G samples, so the group stays too_hard.
RUN = "own"


def _replaced(own_reward: float | None) -> str:
    """A replacement row's augmentation as collect records it (own_reward: the replaced sample's reward;
    None: a store written before it was recorded)."""
    lope = {"replaced": True, "prefix": 0, "prefix_words": 100, "behaviour_mean_logprob": -1.0,
            "behaviour_prompt": "<lorem> q"}
    if own_reward is not None:
        lope["own_reward"] = own_reward
    return json.dumps({"lorem_perturb": lope})


def _kept(correct: int) -> str:
    return json.dumps({"lorem_perturb": {"replaced": False, "resampled": 24, "correct": correct}})


def _group(own: list[float], replaced: int = 0, legacy: bool = False) -> list[tuple[float, bool, str | None]]:
    """Rows (reward, correct, augmentation) of one group: the policy's own rewards `own`, the last `replaced`
    of them replaced by correct LoPE resamples (as lope_rescue does, from the end)."""
    if not replaced:
        return [(r, r == 1.0, None) for r in own]
    g = len(own)
    return [(r, False, _kept(replaced)) if j < g - replaced
            else (1.0, True, _replaced(None if legacy else r)) for j, r in enumerate(own)]


def _land_round(store, prompts: list[dict], groups: dict[str, list[tuple[float, bool, str | None]]],
                run_id: str = RUN) -> None:
    """Land `prompts`, round 0's pool (all active) and its rollouts (groups: prompt_id -> rows)."""
    import datetime as dt

    import pyarrow as pa

    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    store.commit(f"seed-{run_id}", {"prompts": pa.Table.from_pylist([dict(p, created_at=now) for p in prompts])})
    rows = [{"run_id": run_id, "round": 0, "policy_version": 0, "prompt_id": pid, "sample_idx": j,
             "prompt_text": "q", "completion": f"answer {j}", "reward": r, "correct": c, "n_tokens": 3,
             "mean_logprob": -1.0, "finish_reason": "stop", "augmentation": aug}
            for pid, rs in groups.items() for j, (r, c, aug) in enumerate(rs)]
    store.commit("collect", {"rollouts": pa.Table.from_pylist(rows)}, run_id=run_id, round=0)
    ids = [p["prompt_id"] for p in prompts]
    store.commit("pool", {"pool": pa.table({"run_id": [run_id] * len(ids), "round": [0] * len(ids),
                                            "prompt_id": ids, "status": ["active"] * len(ids)})},
                 run_id=run_id, round=0)


def _prompt(name: str, transform: str = "original", root: str | None = None, answer: str = "56") -> dict:
    return {"prompt_id": name, "text": f"Question {name}: what is 7 * 8?", "answer": answer, "source": "test",
            "root_id": root or name, "parent_id": root, "transform": transform, "meta": "{}",
            "solution": "7 * 8 = 56, so \\boxed{56}."}


def test_a_rescued_group_scores_on_the_policys_own_samples(store):
    """0/8 own, 6 replaced by correct resamples: today mean 0.75, EPS 0.207, informative. On the own samples
    it is too_hard with EPS 0; with a format reward on every own sample it is flat. A store written before the
    replaced reward was recorded scores the kept own samples only. The stage summary counts rescued groups
    apart from the buckets."""
    from tasks.score import UtilityConfig, score_task

    groups = {"rescued": _group([0.0] * 8, replaced=6), "format_only": _group([0.1] * 8, replaced=3),
              "legacy": _group([0.0] * 8, replaced=6, legacy=True), "mixed": _group([1, 0, 0, 1, 0, 0, 0, 0])}
    _land_round(store, [_prompt(p) for p in groups], groups)
    out = score_task.fn(round_ctx(store, RUN, 0), UtilityConfig())
    got = {r["prompt_id"]: r for r in scan(store, "prompt_scores").collect().iter_rows(named=True)}
    assert (got["rescued"]["bucket"], got["rescued"]["eps"], got["rescued"]["mean_reward"], got["rescued"]["n"]) \
        == ("too_hard", 0.0, 0.0, 8)
    assert (got["format_only"]["bucket"], got["format_only"]["n"]) == ("flat", 8)
    assert got["format_only"]["mean_reward"] == pytest.approx(0.1)
    assert (got["legacy"]["bucket"], got["legacy"]["n"]) == ("too_hard", 2)
    assert got["mixed"]["bucket"] == "informative" and got["mixed"]["eps"] == pytest.approx(0.461, abs=1e-3)
    assert out["buckets"] == {"informative": 1, "too_hard": 2, "flat": 1}
    assert out["rescued"] == {"groups": 3, "too_hard": 2, "flat": 1}


def test_a_rescued_original_moves_to_reserve_and_enters_the_ladder(store):
    """The pool and refinement read the own-sample bucket: a rescued original is too_hard, so it leaves the
    active pool for reserve and gets its mcq4 rung (today: informative, so it stayed active, unrefined)."""
    from flows.config import RefineConfig
    from storage.query import sql
    from tasks.pool import PoolConfig, pool_task
    from tasks.refine import refine
    from tasks.score import UtilityConfig, score_task

    groups = {"rescued": _group([0.0] * 4, replaced=3), "mixed": _group([1, 0, 0, 1])}
    _land_round(store, [_prompt(p) for p in groups], groups)
    score_task.fn(round_ctx(store, RUN, 0), UtilityConfig())
    refine(round_ctx(store, RUN, 0), store, RefineConfig(strategies=["ladder"]), None)
    pool_task.fn(round_ctx(store, RUN, 1), PoolConfig())
    made = sql(store, "SELECT r.parent_id, p.transform FROM refinements r JOIN prompts p ON p.prompt_id = r.child_id "
                      "WHERE r.accepted").to_pylist()
    assert made == [{"parent_id": "rescued", "transform": "mcq4"}]
    status = {r["prompt_id"]: r["status"] for r in sql(
        store, f"SELECT prompt_id, status FROM pool WHERE run_id = '{RUN}' AND round = 1").to_pylist()}
    assert status["rescued"] == "reserve" and status["mixed"] == "active"


def test_promotion_is_not_fed_by_rescues(store):
    """A ladder rung the policy got 0/4 on, rescued with 3 correct resamples (mean 0.75 over all rows, above
    the 0.5 promotion threshold), is not promoted; one it solved 3/4 on itself is."""
    from flows.config import RefineConfig
    from storage.query import sql
    from tasks.refine import refine
    from tasks.score import UtilityConfig, score_task

    prompts = [_prompt("root_a"), _prompt("root_b"),
               dict(_prompt("mcq4_rescued", "mcq4", "root_a"), meta=json.dumps({"level": "mcq4"})),
               dict(_prompt("mcq4_solved", "mcq4", "root_b"), meta=json.dumps({"level": "mcq4"}))]
    groups = {"mcq4_rescued": _group([0.0] * 4, replaced=3), "mcq4_solved": _group([1, 1, 1, 0])}
    _land_round(store, prompts, groups)
    score_task.fn(round_ctx(store, RUN, 0), UtilityConfig())
    refine(round_ctx(store, RUN, 0), store, RefineConfig(strategies=["ladder"]), None)
    promoted = sql(store, "SELECT parent_id FROM refinements WHERE strategy = 'promote'").column("parent_id")
    assert promoted.to_pylist() == ["mcq4_solved"]


def test_shaping_candidates_are_the_prompts_with_no_correct_own_sample(store):
    """Shaping is for prompts the policy cannot yet solve: no correct rollout among its own samples. A format
    reward (mean 0.1, never correct) and a LoPE rescue (correct replacements, none of its own) qualify; a
    group with one correct own sample does not. Today's filter, mean_reward <= 0, kept only 'never'."""
    from tasks.score import UtilityConfig, score_task
    from tasks.shape import shaping_candidates

    groups = {"never": _group([0.0] * 4), "format_only": _group([0.1] * 4), "rescued": _group([0.0] * 4, replaced=3),
              "solved_once": _group([1, 0, 0, 0]), "partial": _group([0.5, 0.5, 0.5, 0.5])}
    _land_round(store, [_prompt(p) for p in groups], groups)
    score_task.fn(round_ctx(store, RUN, 0), UtilityConfig())
    got = shaping_candidates(store, RUN, 0, limit=10)["prompt_id"].to_list()
    assert got == ["format_only", "never", "partial", "rescued"]
    assert shaping_candidates(store, RUN, 0, limit=2)["prompt_id"].to_list() == ["format_only", "never"]


def test_screened_out_and_all_fail_topped_up_prompts_are_shaping_candidates(store):
    """With screening, `rollouts` holds only mixed groups: the prompts the policy cannot solve are in
    `discarded_rollouts` (an all-fail screen, an all-fail top-up). Those are candidates; an all-pass screen, a
    discarded group with one correct sample, and a discarded row of a later policy version are not."""
    import pyarrow as pa

    from tasks.shape import shaping_candidates

    names = ["kept", "fail_screen", "pass_screen", "fail_topup", "surplus_mixed", "rescored"]
    _land_round(store, [_prompt(p) for p in names], {"kept": _group([1, 0, 0, 0])})

    def rows(pid, rewards, reason, version=0):
        return [{"run_id": RUN, "round": 0, "policy_version": version, "prompt_id": pid, "gen_batch": 1,
                 "reason": reason, "sample_idx": j, "prompt_text": "q", "completion": "a", "reward": float(r),
                 "correct": r == 1, "n_tokens": 3, "mean_logprob": -1.0, "finish_reason": "stop"}
                for j, r in enumerate(rewards)]

    discarded = [*rows("fail_screen", [0, 0], "screened_out"), *rows("pass_screen", [1, 1], "screened_out"),
                 *rows("fail_topup", [0] * 4, "zero_variance"), *rows("surplus_mixed", [0, 1], "surplus"),
                 *rows("rescored", [0, 0], "screened_out", version=1)]
    store.commit("discard", {"discarded_rollouts": pa.Table.from_pylist(discarded)}, run_id=RUN, round=0)
    assert shaping_candidates(store, RUN, 0, limit=10)["prompt_id"].to_list() == ["fail_screen", "fail_topup"]
