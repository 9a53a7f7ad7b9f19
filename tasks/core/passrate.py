"""A pass-rate posterior per prompt, pooled through its bin, and Thompson selection on it (issue 50 item 1; MoPPS'
Beta posteriors and Thompson sampling, GRESO's predict-before-generating; the §4b rule of the design notes).

The method, at zero generated-token cost:
- Bins (`bin_key`, `prompt_bins`): a prompt's bin is its source, its generator's parameters without `seed` and
  `size` (one generator call's bookkeeping, not difficulty: a `harden` child is generated with a seed of its own),
  the scalar difficulty keys of its meta (`DIFFICULTY_KEYS`: a file's `level`/`difficulty`, reasoning-gym's
  per-item `num_digits`/`num_terms`), and, for a child, its transform: a lineage child (ladder rung, hint, rewrite,
  harden) is in a bin of its own, never pooled with originals, whose pass rate differs by construction. A child
  that keeps its root's answer poses the root's problem, so it takes its difficulty from the root row when the
  frame holds it (a ladder rung's meta `level` is the rung's name, not the problem's level); a child with a new
  answer (harden) is a new problem, binned by its own parameters (one and two steps harder stay apart).
- Counts (`pass_counts`): successes and failures of the policy's own, unassisted samples, summed over every group
  the run generated (rollouts, discarded_rollouts, screening and imported groups: the caller concatenates them).
  A LoPE replacement counts as the failed own sample it displaced (tasks/core/eps.py `own_samples`), and a
  few-shot-assisted sample (augmentation `fewshot_context`) is left out: both were drawn under help the
  unassisted prompt will not get, so counting them would inflate its bin's pass rate.
- Posterior (`posterior`): prompt i of bin b is Beta(α_i, β_i) = Beta(a_b + s_i, b_b + f_i), its own counts on its
  bin's prior (a_b, b_b); a never-drawn member inherits the prior, and a bin with no counts is Beta(1, 1). The
  prior (`select.pass_rate_prior`):
  - `fitted` (the default): empirical Bayes. A bin's prompts are a beta-binomial sample: the prior's mean is the
    bin's pass rate m_b = (S_b + ½)/(n_b + 1), and its strength a_b + b_b = 1/ρ_b − 1 comes from ρ_b, the
    intra-class correlation fitted by moments from how far the prompts' own rates spread beyond binomial noise
    (`_overdispersion`, unbiased for a weighted mean), bounded to RHO_RANGE. Prompts that are each
    all-or-nothing (a bin holding 2 + 2 and 47 + 38) give ρ near 1, a U-shaped prior of under one
    pseudo-sample: a unanimous screen then moves a prompt's posterior to its end, as the data does. A bin of
    fewer than MIN_FIT_PROMPTS sampled prompts (or under MIN_FIT_DOF degrees of freedom) takes ρ fitted over
    all bins (every bin's moments pooled). Measured on the evidence store's uniform runs (issue 50, 2,256
    groups of 8, the first two samples read as a screen; benchmarks/prior_calibration.py): after a unanimous
    screen the `pooled` prior predicted a mixed top-up 74% of the time where 26% came out mixed (log loss
    1.15); `fitted` predicted 38% (log loss 0.61), and its prediction of a mixed screen before
    generating went from log loss 0.53 to 0.44.
  - `pooled` (runs stored before `fitted`): bin b pools its members' counts S_b, F_b and shrinks them to at
    most m pseudo-samples (`strength`, 4) on a Beta(1, 1) floor: a_b = 1 + S_b·min(1, m/n_b), b_b likewise.
    Its strength is the same for every bin, so it cannot say that a bin's prompts are all-or-nothing.
  Both priors include the prompt's own counts once more (in the bin's totals); against a bin of many prompts
  the double count is small, and leaving it in keeps the prior one pair per bin.
- P(informative) of a group of G (`p_informative`): 1 − E[p^G] − E[(1−p)^G] under Beta(α, β). The Beta-function
  ratio E[p^G] = B(α+G, β)/B(α, β) is, for integer G, the finite product Π_{j<G} (α+j)/(α+β+j), summed here in
  logs: every factor lies in (0, 1), so it stays finite and exact for any counts (no lgamma differences of huge
  numbers), and 1 − E[(1−p)^G] is taken as −expm1(log …) so a near-certain all-fail bin keeps its small value.
- Thompson selection (`thompson_pick`): one draw p̃_i ~ Beta(α_i, β_i) per candidate, scored by
  P(informative | p̃_i) = 1 − p̃^G − (1 − p̃)^G. The draw is the inverse Beta CDF (scipy, which scikit-learn
  brings) of a uniform keyed by (round_seed(seed, round), prompt id): a prompt draws the same p̃ whichever other
  candidates stand beside it, so two arms at one seed draw alike where their posteriors agree (paired seeds).
  First each non-empty bin takes its floor by score (`floor_fraction` of the batch rounded down, default 3%, at
  least one); the rest of the batch is split over the k-means clusters by their weights (default: their sizes)
  with largest remainder, capped at what each has left, and each cluster takes its top by score.
Each pick carries what a `predictions` row holds: the predicted pass rate (posterior mean) and the predicted
P(informative) (closed form under the posterior, not the draw), beside its draw, score, cluster, bin and reason.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import numpy as np
import polars as pl

from tasks.core.eps import own_samples
from tasks.core.ids import RNG_HEX, seed_of
from tasks.core.seeds import round_seed
from tasks.core.selection import allocate

DIFFICULTY_KEYS = ("level", "difficulty", "num_digits", "num_terms")  # scalar values only: rg's `difficulty` is a dict
NOT_DIFFICULTY = ("seed", "size")  # generator parameters that name a draw, not a difficulty
NEW_PROBLEM = ("harden", "soften")  # children that are new problems with new answers, when `answer` is not given


def _json(text: str | None) -> dict:
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {"_": text}  # not JSON: the text itself is the key
    return value if isinstance(value, dict) else {"_": value}


def bin_key(source: str, params: str | None, meta: str | None, transform: str = "original") -> str:
    """The bin of a prompt from its `prompts` columns: source | generator parameters | difficulty [| transform].

    >>> bin_key("rg:products", '{"max_digits": 2, "seed": 7, "size": 20}', '{"num_digits": 2, "expression": "1*2"}')
    'rg:products | {"max_digits": 2} | {"num_digits": 2}'
    >>> bin_key("math.jsonl", None, '{"level": "Level 5", "subject": "algebra"}', "mcq4")
    'math.jsonl | {} | {"level": "Level 5"} | mcq4'
    """
    gen = {k: v for k, v in _json(params).items() if k not in NOT_DIFFICULTY}
    m = _json(meta)
    level = {k: m[k] for k in DIFFICULTY_KEYS if isinstance(m.get(k), str | int | float | bool)}
    parts = [source, json.dumps(gen, sort_keys=True, default=str), json.dumps(level, sort_keys=True)]
    return " | ".join(parts if transform == "original" else [*parts, transform])


def prompt_bins(prompts: pl.DataFrame) -> pl.DataFrame:
    """(prompt_id, bin) for `prompts` (prompt_id, source, params, meta, transform; root_id and answer let a child
    that poses its root's problem take the root's difficulty, see the module docstring)."""
    rows = prompts.to_dicts()
    by_id = {r["prompt_id"]: r for r in rows}
    out = []
    for r in rows:
        root = by_id.get(r.get("root_id"))
        same_problem = (root is not None and r["transform"] != "original"
                        and (r["answer"] == root["answer"] if "answer" in r else r["transform"] not in NEW_PROBLEM))
        src = root if same_problem else r
        out.append(bin_key(r["source"], src.get("params"), src.get("meta"), r["transform"]))
    return pl.DataFrame({"prompt_id": prompts["prompt_id"], "bin": out}, schema={"prompt_id": pl.String,
                                                                                 "bin": pl.String})


def pass_counts(rollouts: pl.DataFrame | pl.LazyFrame) -> pl.DataFrame:
    """(prompt_id, successes, failures) over `rollouts` rows (columns of `rollouts`/`discarded_rollouts`): the
    policy's own unassisted samples, judged by `correct`. LoPE replacements count as the own failure they
    displaced; few-shot-assisted rows are left out."""
    lf = own_samples(rollouts)
    if "augmentation" in lf.collect_schema().names():
        assisted = pl.col("augmentation").str.json_path_match("$.fewshot_context").is_not_null()
        lf = lf.filter(~assisted.fill_null(False))
    ok = pl.col("correct").cast(pl.Int64)
    return (lf.group_by("prompt_id").agg(successes=ok.sum(), failures=(1 - ok).sum())
            .sort("prompt_id").collect())


PRIORS = ("fitted", "pooled")  # select.pass_rate_prior: how a bin's prior is made (module docstring)
RHO_RANGE = (0.1, 0.95)  # the fitted overdispersion's bounds: a prior of 9 to 0.05 pseudo-samples (the lower
# bound keeps a bin of prompts that look alike exploring its members: the evidence store's fits never reach it)
MIN_FIT_PROMPTS = 5  # a bin with fewer sampled prompts takes the overdispersion fitted over all bins
MIN_FIT_DOF = 4.0  # a bin whose moments have fewer degrees of freedom than this takes the pooled ρ as well


def _overdispersion(n: pl.Expr, s: pl.Expr, mean: pl.Expr) -> tuple[pl.Expr, pl.Expr]:
    """The method-of-moments parts of a beta-binomial's intra-class correlation ρ = 1/(α+β+1) over one bin's
    k prompts (N = Σ n_i samples): Q = Σ n_i (s_i/n_i − m)² / (m(1−m)) − (k − 1) over
    D = N − Σ n_i²/N − (k − 1). With m the bin's own mean, E[Q] = ρ·D (the ANOVA identity for a weighted mean:
    D is (k − 1)(n − 1) at equal n, and 0 for a bin of one prompt, which says nothing of the spread)."""
    spread = (n * (s / n - mean) ** 2 / (mean * (1 - mean))).sum() - (pl.len() - 1)
    return spread, n.sum() - (n ** 2).sum() / n.sum() - (pl.len() - 1)


def fitted_priors(bins: pl.DataFrame, counts: pl.DataFrame) -> pl.DataFrame:
    """(bin, a, b): each sampled bin's empirical-Bayes Beta prior (module docstring, `fitted`)."""
    seen = (bins.join(counts.select("prompt_id", "successes", "failures"), on="prompt_id", how="inner")
            .with_columns(pl.col("successes", "failures").cast(pl.Float64))
            .with_columns(n=pl.col("successes") + pl.col("failures")).filter(pl.col("n") > 0))
    if seen.height == 0:
        return pl.DataFrame(schema={"bin": pl.String, "a": pl.Float64, "b": pl.Float64})
    # the bin's mean, smoothed by half a pseudo-sample each way so an all-fail bin keeps a small pass rate
    mean = (pl.col("successes").sum().over("bin") + 0.5) / (pl.col("n").sum().over("bin") + 1.0)
    seen = seen.with_columns(m=mean)
    spread, dof = _overdispersion(pl.col("n"), pl.col("successes"), pl.col("m"))
    per_bin = seen.group_by("bin").agg(m=pl.col("m").first(), k=pl.len(), spread=spread, dof=dof)
    spread_out = per_bin.filter(pl.col("dof") > 0)  # a one-prompt bin adds nothing to either sum
    total_dof = spread_out["dof"].sum()
    lo, hi = RHO_RANGE
    pooled = float(np.clip(spread_out["spread"].sum() / total_dof, lo, hi)) if total_dof > 0 else 0.5
    rho = (pl.when((pl.col("k") >= MIN_FIT_PROMPTS) & (pl.col("dof") >= MIN_FIT_DOF))
           .then((pl.col("spread") / pl.col("dof")).clip(lo, hi)).otherwise(pooled))
    strength = 1.0 / rho - 1.0
    return per_bin.select("bin", a=pl.col("m") * strength, b=(1 - pl.col("m")) * strength)


def posterior(bins: pl.DataFrame, counts: pl.DataFrame, strength: float = 4.0, prior: str = "fitted") -> pl.DataFrame:
    """(prompt_id, bin, successes, failures, alpha, beta) for every prompt of `bins`. `bins` should hold every
    prompt whose counts should pool (reserve and retired ones too), not only this round's candidates; counts of
    prompts outside `bins` are ignored. `prior`: `fitted` (empirical Bayes per bin) or `pooled` (`strength`
    pseudo-samples on a Beta(1, 1) floor); a bin nobody sampled is Beta(1, 1) under both."""
    if prior not in PRIORS:
        raise ValueError(f"unknown pass-rate prior {prior!r}: use one of {', '.join(PRIORS)}")
    if strength < 0:
        raise ValueError(f"the bin prior's strength must be >= 0 pseudo-samples, got {strength}")
    df = (bins.join(counts.select("prompt_id", "successes", "failures"), on="prompt_id", how="left")
          .with_columns(pl.col("successes", "failures").fill_null(0).cast(pl.Float64)))
    if prior == "fitted":
        fit = fitted_priors(bins, counts)
        return (df.join(fit, on="bin", how="left", maintain_order="left")
                .with_columns(alpha=pl.col("a").fill_null(1.0) + pl.col("successes"),
                              beta=pl.col("b").fill_null(1.0) + pl.col("failures"))
                .drop("a", "b"))
    n_b = pl.col("successes").sum().over("bin") + pl.col("failures").sum().over("bin")
    shrink = pl.when(n_b > strength).then(strength / n_b).otherwise(1.0)
    return df.with_columns(
        alpha=1.0 + pl.col("successes").sum().over("bin") * shrink + pl.col("successes"),
        beta=1.0 + pl.col("failures").sum().over("bin") * shrink + pl.col("failures"),
    )


def predicted_pass_rate(alpha: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """The posterior mean α / (α + β)."""
    return np.asarray(alpha, float) / (np.asarray(alpha, float) + np.asarray(beta, float))


def p_informative(alpha: np.ndarray, beta: np.ndarray, group_size: int) -> np.ndarray:
    """P(a group of G is mixed) = 1 − E[p^G] − E[(1−p)^G] under Beta(α, β), closed form.

    >>> p_informative(np.array([1.0]), np.array([1.0]), 8).round(4).tolist()  # uniform: 1 - 2/(G+1)
    [0.7778]
    """
    a, b = np.asarray(alpha, float)[:, None], np.asarray(beta, float)[:, None]
    j = np.arange(group_size, dtype=float)[None, :]
    log_all_pass = (np.log(a + j) - np.log(a + b + j)).sum(axis=1)
    log_all_fail = (np.log(b + j) - np.log(a + b + j)).sum(axis=1)
    return np.clip(-np.expm1(log_all_fail) - np.exp(log_all_pass), 0.0, 1.0)


def p_informative_at(p: np.ndarray, group_size: int) -> np.ndarray:
    """P(a group of G is mixed | pass rate p) = 1 − p^G − (1−p)^G.

    >>> p_informative_at(np.array([0.0, 0.5, 1.0]), 2).tolist()
    [0.0, 0.5, 0.0]
    """
    p = np.clip(np.asarray(p, float), 0.0, 1.0)
    with np.errstate(divide="ignore"):
        return np.clip(-np.expm1(group_size * np.log1p(-p)) - p**group_size, 0.0, 1.0)


def thompson_draws(prompt_ids: Sequence[str], alpha: np.ndarray, beta: np.ndarray, seed: int,
                   round: int) -> np.ndarray:
    """One p̃ ~ Beta(α_i, β_i) per prompt, keyed by (round_seed(seed, round), prompt id)."""
    from scipy.special import betaincinv

    key = round_seed(seed, round)
    u = (np.array([seed_of(f"{key}:thompson:{p}", RNG_HEX) for p in prompt_ids], float) + 0.5) / 16.0**RNG_HEX
    return betaincinv(np.asarray(alpha, float), np.asarray(beta, float), u)


def thompson_pick(candidates: pl.DataFrame, clusters: Sequence[int] | np.ndarray, bins: Sequence[str], n: int,
                  *, seed: int, round: int, group_size: int = 8, floor_fraction: float = 0.03,
                  cluster_weights: Mapping[int, float] | None = None,
                  diversity_cap: float | None = None) -> pl.DataFrame:
    """`n` picks from `candidates` (prompt_id, alpha, beta; `clusters` and `bins` aligned with its rows), in pick
    order: prompt_id, cluster, bin, draw, score, predicted_pass_rate, predicted_informative, reason. See the
    module docstring for the rule. `cluster_weights` (cluster -> weight; default: the clusters' sizes) sets
    each cluster's share of the batch left after the floors. When there are more non-empty bins than picks,
    the floors go to the bins whose best draw scores highest. With `diversity_cap` (e.g. 2.0) the batch left after
    the floors goes instead by score over all clusters, best first, each cluster capped at ceil(cap x its share of
    the candidates x n) picks (and past the caps, by score alone): a cluster of prompts that only ever failed
    then takes nothing beyond its bins' floors, while no cluster can take more than cap times its share."""
    if not 0.0 <= floor_fraction <= 1.0:
        raise ValueError(f"floor_fraction must be in [0, 1], got {floor_fraction}")
    ids = candidates["prompt_id"].to_list()
    labels, bin_of = np.asarray(clusters, np.int64), np.asarray(bins, dtype=object)
    if not len(labels) == len(bin_of) == len(ids):
        raise ValueError(f"{len(ids)} candidates need as many cluster labels and bins, got {len(labels)} and "
                         f"{len(bin_of)}")
    alpha, beta = candidates["alpha"].to_numpy().astype(float), candidates["beta"].to_numpy().astype(float)
    draw = thompson_draws(ids, alpha, beta, seed, round)
    score = p_informative_at(draw, group_size)
    n = min(n, len(ids))
    order = np.lexsort((np.array(ids, dtype=object), -score))  # best score first, ties by prompt id
    per_bin = max(1, int(floor_fraction * n))
    floor: list[tuple[int, int]] = []  # (rank inside its bin, candidate)
    seen: dict[str, int] = {}
    for i in order:
        rank = seen.get(bin_of[i], 0)
        if rank < per_bin:
            floor.append((rank, int(i)))
            seen[bin_of[i]] = rank + 1
    floor = sorted(floor, key=lambda t: t[0])[:n]  # every bin's best before any bin's second
    chosen = [i for _, i in floor]
    reasons = [f"floor: bin {bin_of[i]}" for i in chosen]
    taken = np.zeros(len(ids), bool)
    taken[chosen] = True
    k = int(labels.max()) + 1 if len(labels) else 0
    sizes = np.bincount(labels, minlength=k)
    left = np.bincount(labels[~taken], minlength=k)
    w = (np.array([cluster_weights.get(c, 0.0) for c in range(k)], float) if cluster_weights is not None
         else sizes.astype(float))
    if diversity_cap is not None:
        cap = np.ceil(diversity_cap * sizes / max(len(ids), 1) * n).astype(np.int64)
        have = np.bincount(labels[taken], minlength=k)
        for capped in (True, False):
            for i in order:
                if len(chosen) >= n:
                    break
                if not taken[i] and (not capped or have[labels[i]] < cap[labels[i]]):
                    taken[i] = True
                    have[labels[i]] += 1
                    chosen.append(int(i))
                    reasons.append(f"thompson: cluster {labels[i]} cap {cap[labels[i]]}/{sizes[labels[i]]}"
                                   if capped else f"thompson: past the caps, cluster {labels[i]}")
        quota = np.zeros(0, np.int64)
    else:
        quota = allocate(n - len(chosen), w, left) if k else np.zeros(0, np.int64)
    for c in np.nonzero(quota)[0]:
        members = [i for i in order if labels[i] == c and not taken[i]][: quota[c]]
        chosen += members
        reasons += [f"thompson: cluster {c} quota {quota[c]}/{sizes[c]}"] * len(members)
    pick = np.asarray(chosen, np.int64)
    return pl.DataFrame({
        "prompt_id": [ids[i] for i in chosen], "cluster": labels[pick], "bin": [bin_of[i] for i in chosen],
        "draw": draw[pick], "score": score[pick], "predicted_pass_rate": predicted_pass_rate(alpha, beta)[pick],
        "predicted_informative": p_informative(alpha[pick], beta[pick], group_size), "reason": reasons,
    }, schema={"prompt_id": pl.String, "cluster": pl.Int32, "bin": pl.String, "draw": pl.Float64,
               "score": pl.Float64, "predicted_pass_rate": pl.Float64, "predicted_informative": pl.Float64,
               "reason": pl.String})
