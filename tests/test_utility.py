import math

import polars as pl
import pytest

from tasks.utility import eps_scores, next_pool

# ALGORITHMS.md §1: EPS for G = 8 binary rewards with k successes
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
