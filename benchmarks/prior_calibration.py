"""How well the pass-rate model predicts before generating, read off a store's full groups (issue 50 items 1-2).

Method: every round r >= 1 of every run whose groups are whole (no screening: uniform's, G samples at once) is
replayed. The model sees the run's groups before round r (tasks/core/passrate.py `pass_counts`, the bins of
`bins_of`); each of round r's groups is read with its first k_s samples as a
screen. For each prior (`pooled`, `fitted`) it prints:
- the unanimous screens' predicted probability that the remaining G - k_s samples are mixed against how many
  were (calibration by decile, log loss): what a posterior top-up pays for;
- the prediction of a mixed screen before generating (log loss);
- simulated samples per informative group of the screening rule (screen k_s, top up mixed screens and unanimous
  ones at P >= threshold), optionally skipping candidates whose predicted P(informative group) is below a cut,
  against the named baseline: the same groups generated whole (uniform).
- the area under the ROC curve of three predictions of an informative group (rewards not all equal) made before
  round r generates anything: the fitted posterior's P(informative group) (its bin); the share of informative
  groups among the k nearest earlier groups of the run by prompt embedding (`embeddings`, cosine; `--knn`);
  and the prompt's own groups in the store's other matched runs (else its nearest prompts' there), what a
  store holding earlier runs of the pool could tell a new run (`--json`: auc_bin, auc_knn, auc_other_runs).
The replay is offline (no model runs) and exact for the groups the store holds, but an idealised screening:
each decision uses the posterior from before the round (the collect refits it with every screen of the round
so far), the round's cap on posterior top-ups and the batch size B are not applied, and a screen's passes are
rewards of 1.0 where the model's counts use `correct` (the same on reasoning-gym, whose rewards pass only at
1.0). It does not model the policy changing with what it trains on: a measure of prediction, not of a
curriculum.

    python benchmarks/prior_calibration.py --store benchmarks/evidence-v2/store --runs 'ev-uniform-%' --json F
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run as a script, benchmarks/select.py would shadow the standard library's `select`

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import polars as pl  # noqa: E402
from scipy.special import betaln  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from storage.query import scan  # noqa: E402
from storage.store import Store  # noqa: E402
from tasks.core.passrate import PRIORS, pass_counts, posterior  # noqa: E402
from tasks.selectors.thompson import PRIOR_STRENGTH, bins_of  # noqa: E402

COLS = ["round", "prompt_id", "sample_idx", "reward", "correct", "augmentation"]


def replay(store: Store, run: str, ks: int) -> pl.DataFrame:
    """One row per group of rounds >= 1: its screen (pass count), whether the screen and the group are mixed, and
    each prior's (alpha, beta) before the round."""
    rows = scan(store, "rollouts").filter(pl.col("run_id") == run).select(COLS).collect()
    bins = bins_of(store, set(rows["prompt_id"].to_list()))
    out = []
    for r in range(1, int(rows["round"].max()) + 1):
        before = pass_counts(rows.filter(pl.col("round") < r))
        post = {p: {x["prompt_id"]: (x["alpha"], x["beta"]) for x in
                    posterior(bins, before, PRIOR_STRENGTH, p).iter_rows(named=True)} for p in PRIORS}
        for (pid,), g in rows.filter(pl.col("round") == r).group_by("prompt_id"):
            rewards = g.sort("sample_idx")["reward"].to_list()
            screen = rewards[:ks]
            out.append({"run": run, "round": r, "prompt_id": pid, "screen_pass": sum(x == 1.0 for x in screen),
                        "screen_mixed": len(set(screen)) > 1, "group_mixed": len(set(rewards)) > 1,
                        "rest_differs": len(set(rewards)) > 1 and len(set(screen)) == 1, "g": len(rewards),
                        **{f"{p}_{k}": post[p][pid][i] for p in PRIORS for i, k in enumerate("ab")}})
    return pl.DataFrame(out)


def _moment(a, b, k_pass, k_fail):
    return np.exp(betaln(a + k_pass, b + k_fail) - betaln(a, b))


def figures(df: pl.DataFrame, ks: int, threshold: float, skips: list[float]) -> dict:
    g = int(df["g"].mode()[0])
    rest = g - ks
    unanimous = df.filter(~pl.col("screen_mixed"))
    y = unanimous["rest_differs"].to_numpy()
    mixed, informative = df["screen_mixed"].to_numpy(), df["group_mixed"].to_numpy()
    out = {"groups": df.height, "group_size": g, "screen_samples": ks, "threshold": threshold,
           "uniform_samples_per_informative": g * df.height / max(int(informative.sum()), 1),
           "observed_mixed_rest_after_unanimous": float(y.mean()), "observed_mixed_screen": float(mixed.mean()),
           "priors": {}}
    for p in PRIORS:
        a, b = df[f"{p}_a"].to_numpy(), df[f"{p}_b"].to_numpy()
        s = df["screen_pass"].to_numpy()
        a2, b2 = a + s, b + ks - s  # after the screen
        all_pass = s == ks
        p_rest = np.where(all_pass, 1 - _moment(a2, b2, rest, 0), 1 - _moment(a2, b2, 0, rest))
        p_screen = 1 - _moment(a, b, ks, 0) - _moment(a, b, 0, ks)
        p_group = 1 - _moment(a, b, g, 0) - _moment(a, b, 0, g)
        pu = np.clip(p_rest[~mixed], 1e-6, 1 - 1e-6)
        ps = np.clip(p_screen, 1e-6, 1 - 1e-6)
        deciles = []
        for lo in np.arange(0, 1, 0.1):
            m = (pu >= lo) & (pu < lo + 0.1 + (1e-9 if lo >= 0.9 else 0))
            if m.sum():
                deciles.append({"from": round(float(lo), 1), "n": int(m.sum()), "predicted": float(pu[m].mean()),
                                "observed": float(y[m].mean())})
        sims = {}
        for cut in skips:
            keep = p_group >= cut
            top = keep & (mixed | (p_rest >= threshold))
            samples = ks * keep.sum() + rest * top.sum()
            got = int((top & informative).sum())
            sims[str(cut)] = {"screened": int(keep.sum()), "topped_up": int(top.sum()), "informative": got,
                              "samples_per_informative": float(samples / max(got, 1))}
        out["priors"][p] = {
            "predicted_mixed_rest_after_unanimous": float(pu.mean()),
            "log_loss_rest": float(-np.mean(y * np.log(pu) + (1 - y) * np.log(1 - pu))),
            "log_loss_screen": float(-np.mean(mixed * np.log(ps) + (1 - mixed) * np.log(1 - ps))),
            "deciles": deciles, "screening": sims}
    return out


def _unit(v) -> np.ndarray:
    m = np.stack([np.asarray(x, np.float32) for x in v])
    return m / np.maximum(np.linalg.norm(m, axis=1, keepdims=True), 1e-12)


def predictor_auc(store: Store, replayed: pl.DataFrame, k: int) -> dict:
    """AUC of the fitted posterior, a k-NN over the run's earlier groups and the other runs' groups (module
    docstring) over the groups of `replayed` (`replay`'s rows); {} where the store lacks their embeddings."""
    from sklearn.metrics import roc_auc_score

    runs = replayed["run"].unique().sort().to_list()
    groups = (scan(store, "rollouts").filter(pl.col("run_id").is_in(runs)).group_by("run_id", "round", "prompt_id")
              .agg((pl.col("reward").max() > pl.col("reward").min()).alias("informative")).collect())
    emb = (scan(store, "embeddings").filter(pl.col("prompt_id").is_in(groups["prompt_id"].unique().to_list()))
           .select("prompt_id", "embedder", "vector").collect().sort("embedder", "prompt_id")
           .unique("prompt_id", keep="first", maintain_order=True))  # one embedder's vector, whichever run asks
    if emb.height < groups["prompt_id"].n_unique():
        return {}
    vec = dict(zip(emb["prompt_id"].to_list(), _unit(emb["vector"].to_list())))
    y, p_knn, p_other = [], [], []
    for run in runs:
        mine, other = groups.filter(pl.col("run_id") == run), groups.filter(pl.col("run_id") != run)
        seen = other.group_by("prompt_id").agg(pl.col("informative").mean())
        rate = dict(seen.iter_rows())
        seen_vec = np.stack([vec[q] for q in seen["prompt_id"]]) if seen.height else None
        for r in range(1, int(mine["round"].max()) + 1):
            past, now = mine.filter(pl.col("round") < r), mine.filter(pl.col("round") == r).sort("prompt_id")
            if now.height == 0 or past.height == 0:
                continue  # a round without groups (replay has none for it either)
            here = np.stack([vec[q] for q in now["prompt_id"]])
            near = np.argsort(-(here @ np.stack([vec[q] for q in past["prompt_id"]]).T), axis=1)[:, :k]
            p_knn += list(past["informative"].to_numpy().astype(float)[near].mean(axis=1))
            if seen_vec is not None:
                far = np.argsort(-(here @ seen_vec.T), axis=1)[:, :k]
                nearest = seen["informative"].to_numpy()[far].mean(axis=1)
                p_other += [rate.get(q, f) for q, f in zip(now["prompt_id"], nearest)]
            y += now["informative"].to_list()
    ordered = replayed.sort("run", "round", "prompt_id")
    a, b, g = ordered["fitted_a"].to_numpy(), ordered["fitted_b"].to_numpy(), ordered["g"].to_numpy()
    p_bin = 1 - _moment(a, b, g, 0) - _moment(a, b, 0, g)
    if ordered["group_mixed"].to_list() != y:
        raise ValueError("prior_calibration: the replayed groups and the stored ones disagree")
    out = {"auc_bin": float(roc_auc_score(y, p_bin)), "auc_knn": float(roc_auc_score(y, p_knn)),
           "informative_rate": float(np.mean(y)), "groups": len(y), "knn": k}
    if len(p_other) == len(y):
        out["auc_other_runs"] = float(roc_auc_score(y, p_other))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default="benchmarks/evidence-v2/store")
    ap.add_argument("--runs", default="ev-uniform-%", help="run ids (SQL LIKE) whose groups are whole")
    ap.add_argument("--screen-samples", type=int, default=2)
    ap.add_argument("--threshold", type=float, default=0.7, help="rollout.screen_topup_threshold")
    ap.add_argument("--skip", default="0,0.3", help="P(informative group) cuts to simulate skipping below")
    ap.add_argument("--knn", type=int, default=10, help="neighbours of the k-NN prediction")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    store = Store(a.store)
    runs = (scan(store, "rollouts").select("run_id").unique().collect()
            .filter(pl.col("run_id").str.contains("^" + a.runs.replace("%", ".*") + "$"))["run_id"].sort().to_list())
    if not runs:
        raise SystemExit(f"prior_calibration: no run of {a.store} matches {a.runs!r}")
    per_run = {r: figures(replay(store, r, a.screen_samples), a.screen_samples, a.threshold,
                          [float(x) for x in a.skip.split(",")]) for r in runs}
    replayed = pl.concat([replay(store, r, a.screen_samples) for r in runs])
    both = figures(replayed, a.screen_samples, a.threshold, [float(x) for x in a.skip.split(",")])
    both["auc"] = predictor_auc(store, replayed, a.knn)
    base = both["uniform_samples_per_informative"]
    print(f"{len(runs)} runs, {both['groups']} groups of {both['group_size']} replayed with a screen of "
          f"{a.screen_samples}; baseline: uniform (whole groups) {base:.1f} samples per informative group")
    print(f"after a unanimous screen the rest came out mixed {both['observed_mixed_rest_after_unanimous']:.3f}; "
          f"screens were mixed {both['observed_mixed_screen']:.3f}")
    for p, f in both["priors"].items():
        print(f"{p:7s} predicted mixed rest {f['predicted_mixed_rest_after_unanimous']:.3f} (log loss "
              f"{f['log_loss_rest']:.3f}); mixed screen log loss {f['log_loss_screen']:.3f}")
        for cut, s in f["screening"].items():
            spread = [per_run[r]["priors"][p]["screening"][cut]["samples_per_informative"] for r in runs]
            print(f"        screening, top-up >= {a.threshold}, skip P(inf) < {cut}: "
                  f"{s['samples_per_informative']:.1f} samples per informative group, "
                  f"{base / s['samples_per_informative']:.2f}x uniform (runs: median "
                  f"{statistics.median(spread):.1f}, {min(spread):.1f}-{max(spread):.1f})")
    auc = both["auc"]
    print(f"AUC of an informative group, predicted before its round ({auc['groups']} groups, "
          f"{auc['informative_rate']:.3f} informative): fitted bin posterior {auc['auc_bin']:.3f}, {a.knn}-NN over "
          f"the run's earlier groups by embedding {auc['auc_knn']:.3f}, the prompt's groups in the other runs "
          f"{auc['auc_other_runs']:.3f}" if "auc_other_runs" in auc else
          f"AUC: fitted bin posterior {auc['auc_bin']:.3f}, {a.knn}-NN {auc['auc_knn']:.3f}" if auc else
          "AUC: the store holds no embeddings of these prompts")
    if a.json:
        Path(a.json).write_text(json.dumps({"store": a.store, "runs": runs, "all": both, "per_run": per_run}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
