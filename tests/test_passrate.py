"""The pass-rate posterior and Thompson selection (tasks/core/passrate.py; issue 50 item 1): the closed form of
P(informative) matches Monte-Carlo, a bin whose prompts all failed lends its low pass rate to its never-drawn
members yet is still drawn at the floor, every non-empty bin gets its floor, draws are keyed by (seed, round,
prompt), and huge counts stay finite."""

import json
import math

import numpy as np
import polars as pl
import pytest

from tasks.core.passrate import (
    RHO_RANGE,
    bin_key,
    fitted_priors,
    p_informative,
    p_informative_at,
    pass_counts,
    posterior,
    prompt_bins,
    thompson_draws,
    thompson_pick,
)

G = 8


def _lgamma_form(a: float, b: float, g: int) -> float:
    """1 - B(a+g, b)/B(a, b) - B(a, b+g)/B(a, b) with log-Beta from math.lgamma: the textbook form."""
    def lbeta(x, y):
        return math.lgamma(x) + math.lgamma(y) - math.lgamma(x + y)
    return 1 - math.exp(lbeta(a + g, b) - lbeta(a, b)) - math.exp(lbeta(a, b + g) - lbeta(a, b))


@pytest.mark.parametrize("a,b,g", [(1, 1, 8), (2, 5, 8), (0.5, 0.5, 4), (9, 1, 8), (3, 30, 16), (1, 13, 2)])
def test_closed_form_matches_monte_carlo_and_the_beta_function_form(a, b, g):
    p = np.random.default_rng(0).beta(a, b, size=400_000)
    mc = float(np.mean(1 - p**g - (1 - p) ** g))
    got = float(p_informative(np.array([a], float), np.array([b], float), g)[0])
    assert got == pytest.approx(mc, abs=4e-3)
    assert got == pytest.approx(_lgamma_form(a, b, g), abs=1e-12)
    assert float(p_informative_at(np.array([0.3]), g)[0]) == pytest.approx(1 - 0.3**g - 0.7**g)


def _rollouts(groups: dict[str, list[int]], extra: list[dict] = ()) -> pl.DataFrame:
    rows = [{"prompt_id": pid, "round": r, "reward": float(c), "correct": bool(c), "augmentation": None}
            for pid, gs in groups.items() for r, k in enumerate(gs) for c in [1] * k + [0] * (G - k)]
    return pl.DataFrame([*rows, *extra], schema={"prompt_id": pl.String, "round": pl.Int32, "reward": pl.Float64,
                                                 "correct": pl.Boolean, "augmentation": pl.String})


def _bins(prefix: str, n: int, key: str) -> pl.DataFrame:
    return pl.DataFrame({"prompt_id": [f"{prefix}{i}" for i in range(n)], "bin": [key] * n})


def test_counts_are_own_unassisted_samples():
    """A LoPE replacement counts as the own failure it displaced; a few-shot-assisted sample does not count."""
    lope = {"prompt_id": "a", "round": 9, "reward": 1.0, "correct": True,
            "augmentation": json.dumps({"lorem_perturb": {"replaced": True, "own_reward": 0.0}})}
    fewshot = {"prompt_id": "a", "round": 9, "reward": 1.0, "correct": True,
               "augmentation": json.dumps({"fewshot_context": ["z"], "p": 0.5})}
    got = pass_counts(_rollouts({"a": [0, 2], "b": [8]}, [lope, fewshot])).to_dicts()
    assert got == [{"prompt_id": "a", "successes": 2, "failures": 15}, {"prompt_id": "b", "successes": 8,
                                                                        "failures": 0}]


def _failed_and_mixed(prior: str = "fitted"):
    """Bin 'hard': 8 prompts drawn once at 0/8 and 4 never drawn; bin 'mixed': 12 prompts drawn once at 4/8; bin
    'fresh': 4 prompts nobody drew."""
    counts = pass_counts(_rollouts({**{f"h{i}": [0] for i in range(8)}, **{f"m{i}": [4] for i in range(12)}}))
    bins = pl.concat([_bins("h", 12, "hard"), _bins("m", 12, "mixed"), _bins("f", 4, "fresh")])
    return posterior(bins, counts, prior=prior)


@pytest.mark.parametrize("prior", ["pooled", "fitted"])
def test_an_all_fail_bin_lends_its_low_pass_rate_to_its_never_drawn_members(prior):
    post = {r["prompt_id"]: r for r in _failed_and_mixed(prior).to_dicts()}
    never, fresh, mixed = post["h11"], post["f0"], post["m0"]
    assert (fresh["alpha"], fresh["beta"]) == (1.0, 1.0)  # a bin nobody sampled
    pinf = {k: float(p_informative(np.array([r["alpha"]]), np.array([r["beta"]]), G)[0])
            for k, r in (("never", never), ("fresh", fresh), ("mixed", mixed), ("drawn", post["h0"]))}
    assert pinf["drawn"] <= pinf["never"] < pinf["fresh"] < pinf["mixed"]
    if prior == "pooled":  # 64 failures shrunk to 4 pseudo-samples on Beta(1, 1): Beta(1, 5), mean 1/6
        assert (never["alpha"], never["beta"]) == (1.0, 5.0)
        assert pinf["drawn"] < 0.45 and pinf["never"] < 0.62 and pinf["mixed"] > 0.95
    else:  # eight prompts alike at 0/8 spread no wider than binomial noise: the tightest prior, at the bin's 0.5/65
        assert never["alpha"] / (never["alpha"] + never["beta"]) == pytest.approx(0.5 / 65)
        assert never["alpha"] + never["beta"] == pytest.approx(1 / RHO_RANGE[0] - 1)
        assert pinf["never"] < 0.1 and pinf["mixed"] > 0.95


def _bimodal(n_dead: int, n_solved: int, n_mid: int = 0):
    """One bin: prompts drawn once at 0/8 (dead), 8/8 (solved) and 4/8; returns its bins and counts."""
    spec = {**{f"d{i}": [0] for i in range(n_dead)}, **{f"s{i}": [8] for i in range(n_solved)},
            **{f"m{i}": [4] for i in range(n_mid)}}
    bins = pl.DataFrame({"prompt_id": [*spec, "new"], "bin": ["b"] * (len(spec) + 1)})
    return bins, pass_counts(_rollouts(spec))


def test_the_fitted_prior_of_an_all_or_nothing_bin_is_u_shaped():
    """A bin whose prompts are each dead or solved: the fitted prior has under one pseudo-sample, so a new
    member's two failed screens make a mixed top-up of 6 unlikely; the pooled prior (4 pseudo-samples at the
    bin's mean) still calls it likely, which is what the evidence runs' posterior top-ups paid for."""
    bins, counts = _bimodal(12, 8)
    post = {p: posterior(bins, counts, prior=p).filter(pl.col("prompt_id") == "new").row(0, named=True)
            for p in ("fitted", "pooled")}
    fit = post["fitted"]
    assert fit["alpha"] + fit["beta"] < 1 and fit["alpha"] / (fit["alpha"] + fit["beta"]) == pytest.approx(64.5 / 161)
    after = {p: float(p_informative(np.array([r["alpha"]]), np.array([r["beta"] + 2]), 6)[0])
             for p, r in post.items()}  # the posterior after a screen of two failures: P(the next 6 are mixed)
    assert after["fitted"] < 0.2 < 0.5 < after["pooled"]
    # a bin of prompts alike at 4/8 takes the strongest prior at its mean: no spread beyond binomial noise
    bins, counts = _bimodal(0, 0, 10)
    mid = posterior(bins, counts).filter(pl.col("prompt_id") == "new").row(0, named=True)
    assert mid["alpha"] + mid["beta"] == pytest.approx(1 / RHO_RANGE[0] - 1) and mid["alpha"] == mid["beta"]


def test_the_fitted_prior_recovers_a_beta_binomials_parameters():
    """400 prompts with pass rates drawn from Beta(2, 6), 8 samples each: the moment fit finds the prior's mean
    0.25 and its strength 8 (intra-class correlation 1/9) to within sampling error."""
    rng = np.random.default_rng(0)
    p = rng.beta(2.0, 6.0, 400)
    s = rng.binomial(8, p)
    counts = pl.DataFrame({"prompt_id": [f"q{i}" for i in range(400)], "successes": s, "failures": 8 - s})
    fit = fitted_priors(pl.DataFrame({"prompt_id": counts["prompt_id"], "bin": ["b"] * 400}), counts).row(0, named=True)
    assert fit["a"] / (fit["a"] + fit["b"]) == pytest.approx(0.25, abs=0.02)
    assert 6.0 < fit["a"] + fit["b"] < 10.5


def test_the_pooled_spread_is_unbiased_over_many_thin_bins():
    """300 bins of two prompts (8 samples each, pass rates from Beta(0.5, 0.5): ρ = 1/2) and 200 bins of one:
    the spread pooled over them recovers ρ, so a thin bin's prior has about 1 pseudo-sample. Dividing by
    Σ(n_i − 1), with the bin mean fitted from the same samples and one-prompt bins counted, said ρ ≈ 0.2."""
    rng = np.random.default_rng(1)
    ids, bins_, s = [], [], []
    for b in range(500):
        for j in range(2 if b < 300 else 1):
            ids.append(f"p{b}-{j}")
            bins_.append(f"b{b}")
            s.append(int(rng.binomial(8, rng.beta(0.5, 0.5))))
    counts = pl.DataFrame({"prompt_id": ids, "successes": s, "failures": [8 - x for x in s]})
    fit = fitted_priors(pl.DataFrame({"prompt_id": ids, "bin": bins_}), counts)
    strength = fit["a"] + fit["b"]
    assert strength.n_unique() == 1 and 0.6 < strength[0] < 1.6


def test_a_thin_bin_borrows_the_spread_fitted_over_all_bins():
    """A bin of two sampled prompts is too few to fit its own spread: it takes the one fitted over all bins."""
    bins, counts = _bimodal(12, 8)
    thin = pl.DataFrame({"prompt_id": ["t0", "t1", "t2"], "bin": ["thin"] * 3})
    more = pl.DataFrame({"prompt_id": ["t0", "t1"], "successes": [0, 8], "failures": [8, 0]})
    fit = fitted_priors(pl.concat([bins, thin]), pl.concat([counts, more.with_columns(
        pl.col("successes", "failures").cast(counts["successes"].dtype))]))
    strength = dict(zip(fit["bin"], (fit["a"] + fit["b"]).to_list()))
    assert strength["thin"] == pytest.approx(strength["b"], rel=0.2) and strength["thin"] < 1


@pytest.mark.parametrize("prior,explores", [("pooled", 1 / 2), ("fitted", 1 / 3)])
def test_the_all_fail_bin_is_drawn_at_the_floor_not_at_its_share(prior, explores):
    """8 picks from 12 'hard' and 12 'mixed' prompts, over 40 rounds: the hard bin's pool share is 4 a round.
    Its floor picks favour the 4 members nobody drew (a third of the bin): under the pooled prior, most picks;
    under the fitted one, which reads 8 prompts alike at 0/8 as a bin whose members are alike, above their share."""
    post = _failed_and_mixed(prior).filter(pl.col("bin") != "fresh")
    clusters = np.arange(post.height) % 3  # every cluster mixes both bins
    per_round, never_drawn = [], 0
    for rnd in range(40):
        picks = thompson_pick(post, clusters, post["bin"].to_list(), 8, seed=1, round=rnd)
        assert picks.height == 8 and picks["prompt_id"].n_unique() == 8
        hard = picks.filter(pl.col("bin") == "hard")
        per_round.append(hard.height)
        never_drawn += hard["prompt_id"].is_in(["h8", "h9", "h10", "h11"]).sum()
    assert min(per_round) >= 1  # the floor: 3% of 8 rounds down to 0, and at least one
    assert np.mean(per_round) < 1.3
    assert never_drawn > sum(per_round) * explores


def test_every_non_empty_bin_gets_its_floor():
    rng = np.random.default_rng(3)
    n_bins, per = 6, 10
    cands = pl.DataFrame({"prompt_id": [f"p{i}" for i in range(n_bins * per)],
                          "alpha": np.r_[np.full(per, 1.0), rng.uniform(20, 40, (n_bins - 1) * per)],
                          "beta": np.r_[np.full(per, 500.0), rng.uniform(20, 40, (n_bins - 1) * per)]})
    bins = [f"b{i // per}" for i in range(cands.height)]  # b0: all but hopeless
    clusters = np.arange(cands.height) % 4
    picks = thompson_pick(cands, clusters, bins, 20, seed=0, round=0)
    assert set(picks["bin"]) == {f"b{i}" for i in range(n_bins)} and (picks["bin"] == "b0").sum() == 1
    assert picks.filter(pl.col("bin") == "b0")["reason"].to_list() == ["floor: bin b0"]
    wide = thompson_pick(cands, clusters, bins, 30, seed=0, round=0, floor_fraction=0.15)  # int(4.5) = 4 per bin
    assert (wide["bin"] == "b0").sum() == 4
    # more bins than picks: one per bin as far as the batch goes, never two from one bin
    few = thompson_pick(cands, clusters, bins, 4, seed=0, round=0)
    assert few.height == 4 and few["bin"].n_unique() == 4


def test_draws_are_keyed_by_seed_round_and_prompt():
    post = _failed_and_mixed()
    bins, clusters = post["bin"].to_list(), np.arange(post.height) % 2
    a = thompson_pick(post, clusters, bins, 10, seed=5, round=2)
    assert a.equals(thompson_pick(post, clusters, bins, 10, seed=5, round=2))
    assert not a.equals(thompson_pick(post, clusters, bins, 10, seed=5, round=3))
    ids = post["prompt_id"].to_list()
    alpha, beta = post["alpha"].to_numpy(), post["beta"].to_numpy()
    full = thompson_draws(ids, alpha, beta, 5, 2)
    part = thompson_draws(ids[3:9], alpha[3:9], beta[3:9], 5, 2)
    assert np.array_equal(full[3:9], part)  # a prompt's draw does not depend on who else stands beside it
    # each pick records the posterior's prediction, not its draw
    row = a.join(post, on="prompt_id").row(0, named=True)
    assert row["predicted_pass_rate"] == pytest.approx(row["alpha"] / (row["alpha"] + row["beta"]))


def test_large_counts_stay_finite():
    a = np.array([1e9, 1.0, 1e9, 3e7])
    b = np.array([1e9, 1e9, 1.0, 1e7])
    pinf = p_informative(a, b, 64)
    assert np.isfinite(pinf).all() and pinf[0] == pytest.approx(1.0) and 0 < pinf[1] < 1e-6
    assert pinf[1] == pytest.approx(64 / (1e9 + 1), rel=1e-3)  # 1 - E[(1-p)^G] ~ G E[p] for a tiny p
    assert pinf[3] == pytest.approx(1 - 0.75**64 - 0.25**64, abs=1e-6)
    draws = thompson_draws(["a", "b", "c", "d"], a, b, 0, 0)
    assert np.isfinite(draws).all() and abs(draws[0] - 0.5) < 1e-3 and abs(draws[3] - 0.75) < 1e-3
    big = pl.DataFrame({"prompt_id": ["a", "b", "c", "d"], "successes": [10**9, 0, 10**9, 3 * 10**7],
                        "failures": [10**9, 10**9, 0, 10**7]})
    post = posterior(pl.DataFrame({"prompt_id": ["a", "b", "c", "d"], "bin": ["x"] * 4}), big)
    assert np.isfinite(post["alpha"].to_numpy()).all() and np.isfinite(post["beta"].to_numpy()).all()


def test_bins_split_source_difficulty_and_lineage():
    root = {"prompt_id": "r", "root_id": "r", "source": "rg:products", "answer": "56", "transform": "original",
            "params": json.dumps({"min_digits": 2, "max_digits": 2, "seed": 1, "size": 4}),
            "meta": json.dumps({"num_digits": 2, "num_terms": 2, "difficulty": {"num_digits": [2, 2]}})}
    sibling = dict(root, prompt_id="s", root_id="s", params=json.dumps({"min_digits": 2, "max_digits": 2,
                                                                        "seed": 9, "size": 1}))
    rung = dict(root, prompt_id="m", transform="mcq4", meta=json.dumps({"num_digits": 2, "level": "mcq4"}))
    hard = dict(root, prompt_id="h", transform="harden", answer="5040",
                params=json.dumps({"max_digits": 3, "seed": 5, "size": 1}), meta=json.dumps({"num_digits": 3}))
    got = dict(prompt_bins(pl.DataFrame([root, sibling, rung, hard])).iter_rows())
    key = 'rg:products | {"max_digits": 2, "min_digits": 2} | {"num_digits": 2, "num_terms": 2}'
    assert got["r"] == got["s"] == key
    assert got["m"] == got["r"] + " | mcq4"  # the root's problem, in a bin of its own
    assert got["h"] == 'rg:products | {"max_digits": 3} | {"num_digits": 3} | harden'
    assert bin_key("f.jsonl", None, None) == "f.jsonl | {} | {}"


def test_the_diversity_cap_takes_by_score_and_caps_each_cluster():
    """With a cap, picks after the floors go by score over all clusters, none past ceil(cap x share x n): a
    cluster of all-fail prompts gets its bin's floor only, and the best cluster no more than its cap."""
    from tasks.core.passrate import thompson_pick

    ids = [f"good{i}" for i in range(12)] + [f"fail{i}" for i in range(12)]
    cand = pl.DataFrame({"prompt_id": ids, "alpha": [5.0] * 12 + [1.0] * 12, "beta": [5.0] * 12 + [40.0] * 12})
    clusters = [0] * 6 + [1] * 6 + [2] * 12
    bins = ["good"] * 12 + ["fail"] * 12
    picks = thompson_pick(cand, clusters, bins, 8, seed=0, round=1, group_size=8, diversity_cap=2.0)
    fail = picks.filter(pl.col("bin") == "fail")
    assert fail.height == 1 and fail["reason"][0].startswith("floor")
    per_cluster = picks.group_by("cluster").len()
    assert per_cluster.filter(pl.col("cluster") != 2)["len"].max() <= 4  # ceil(2 x 6/24 x 8) = 4
