"""What screening could make of plain GRPO's own groups: a counterfactual over a store's full groups, no model run.

Each stored full group (G samples drawn at once, as the `uniform` arm draws them) holds the screen a screening
round would have drawn for it: its first k_s samples (sample_idx 0..k_s-1, sampled as the rest). So every
top-up rule can be replayed on the same groups, and set beside the baseline that generated them, plain GRPO:
- `plain`: every group in full (the baseline: what the store's runs spent and made);
- `mixed_only`: top up only the screens whose rewards differ (what screening keeps for sure);
- `and_pass`: those and the unanimous all-correct screens; `and_fail`: those and the unanimous others;
- `best`: the set of kinds of unanimous screens (all-correct, other) per stratum to top up, besides the mixed
  ones, that gives the fewest tokens per informative group over all strata (`best_topups`: a kind is in it
  iff its top-up tokens per informative group it completes are below that optimum, Dinkelbach's iteration).
  It reads them off the very groups it is scored on: with hindsight, the most any top-up rule that decides by
  stratum and screen outcome could make;
- `oracle`: only the groups that came out mixed, in full: the most any prediction before generating could make.
Figure of merit: generated tokens per informative group (rewards not all equal), per stratum (round 0's pool
source entry) and over all, and its ratio to `plain`'s (above 1: fewer tokens per informative group than plain
GRPO), with each rule's informative groups by stratum as a share (the composition the held-out set sees).
Screening draws candidates as the baseline drew them, so a rule's composition is plain's, thinned by the rule.
benchmarks/prior_calibration.py replays the shipped rule itself (its posterior, its threshold); this bounds every
rule of the family, and how far prediction alone could go.

    python benchmarks/screening_ceiling.py [--store benchmarks/evidence-v3/store] [--runs ev-uniform-]
                                           [--screen-samples 2] [--json PATH]

--json PATH writes flat keys: tokens_per_informative_<rule> and ratio_<rule> over all strata, groups,
group_size, screen_samples, and informative_share_<rule>_<stratum index> (strata numbered in the printed order).
"""

from __future__ import annotations

import os
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run as a script, benchmarks/select.py would shadow the standard library's `select`

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import polars as pl  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RULES = ["plain", "mixed_only", "and_pass", "and_fail", "best", "oracle"]


def screen_kinds(rows: pl.DataFrame, screen_samples: int) -> pl.DataFrame:
    """One row per group (stratum, run_id, round, prompt_id; rows: sample_idx, reward, n_tokens): its screen's
    kind ('mixed', 'pass': all rewards 1, 'fail': the other unanimous screens), whether the full group is
    informative, and its tokens split into the screen's and the top-up's."""
    screen = pl.col("sample_idx") < screen_samples
    groups = rows.group_by("stratum", "run_id", "round", "prompt_id").agg(
        pl.len().alias("size"),
        (pl.col("reward").filter(screen).max() > pl.col("reward").filter(screen).min()).alias("screen_mixed"),
        (pl.col("reward").filter(screen).min() == 1.0).alias("screen_pass"),
        (pl.col("reward").max() > pl.col("reward").min()).alias("informative"),
        pl.col("n_tokens").filter(screen).sum().alias("screen_tokens"),
        pl.col("n_tokens").filter(~screen).sum().alias("topup_tokens"))
    sizes = groups["size"].unique().to_list()
    if len(sizes) != 1 or not 0 < screen_samples < sizes[0]:
        raise ValueError(f"screening counterfactual: needs full groups of one size above --screen-samples "
                         f"{screen_samples}; the runs hold groups of {sorted(sizes)} samples")
    kind = (pl.when(pl.col("screen_mixed")).then(pl.lit("mixed"))
            .when(pl.col("screen_pass")).then(pl.lit("pass")).otherwise(pl.lit("fail")))
    return groups.with_columns(kind.alias("kind")).drop("screen_mixed", "screen_pass")


def best_topups(groups: pl.DataFrame) -> set[tuple[str, str]]:
    """The (stratum, kind) pairs of unanimous screens whose top-ups, with the mixed screens', give the fewest
    tokens per informative group over all strata: the minimal ratio (A + sum c_k) / (B + sum b_k) over subsets
    of kinds (A, B: every screen's tokens plus the mixed screens' top-ups, and their informative groups; c_k,
    b_k: a kind's top-up tokens and the informative groups they complete) holds exactly the kinds with
    c_k / b_k below the optimum itself, which Dinkelbach's iteration finds in a few steps."""
    mixed = pl.col("kind") == "mixed"
    a = float(groups["screen_tokens"].sum() + groups.filter(mixed)["topup_tokens"].sum())
    b = float(groups.filter(mixed).height)
    kinds = groups.filter(~mixed).group_by("stratum", "kind").agg(pl.col("topup_tokens").sum().alias("c"),
                                                                    pl.col("informative").sum().alias("b"))
    kinds = [(s, k, float(c), float(n)) for s, k, c, n in kinds.iter_rows() if n > 0]
    chosen: set[tuple[str, str]] = set()
    while True:
        ratio = (a + sum(c for s, k, c, n in kinds if (s, k) in chosen)) / max(
            b + sum(n for s, k, c, n in kinds if (s, k) in chosen), 1e-12)
        better = {(s, k) for s, k, c, n in kinds if c / n < ratio}
        if better == chosen:
            return chosen
        chosen = better


def counterfactual(groups: pl.DataFrame) -> pl.DataFrame:
    """Per (stratum, rule): groups, informative groups, tokens (see the module docstring for the rules); a
    stratum where a rule keeps nothing has its row, at zero."""
    best = pl.DataFrame(sorted(best_topups(groups)), schema={"stratum": pl.String, "kind": pl.String}, orient="row")
    groups = groups.join(best.with_columns(pl.lit(True).alias("best")), on=["stratum", "kind"], how="left")
    groups = groups.with_columns(pl.col("best").fill_null(False))
    mixed, kind = pl.col("kind") == "mixed", pl.col("kind")
    topped = {"plain": pl.lit(True), "mixed_only": mixed, "and_pass": mixed | (kind == "pass"),
              "and_fail": mixed | (kind == "fail"), "best": mixed | pl.col("best"), "oracle": pl.col("informative")}
    strata = groups.select("stratum").unique()
    out = []
    for rule, up in topped.items():
        screened = rule not in ("plain", "oracle")  # plain and the oracle draw G at once, no screen
        drawn = groups if rule != "oracle" else groups.filter(pl.col("informative"))
        tokens = pl.when(up).then(pl.col("screen_tokens") + pl.col("topup_tokens")).otherwise(
            pl.col("screen_tokens") if screened else 0)
        got = drawn.group_by("stratum").agg(pl.len().alias("groups"),
                                            (pl.col("informative") & up).sum().alias("informative"),
                                            tokens.sum().alias("tokens"))
        out.append(strata.join(got, on="stratum", how="left").fill_null(0).with_columns(pl.lit(rule).alias("rule"))
                   .select("stratum", "rule", pl.col("groups", "informative", "tokens").cast(pl.Int64)))
    return pl.concat(out).sort("stratum", "rule")


def table(result: pl.DataFrame) -> tuple[list[str], dict]:
    """The printed lines and the --json figures."""
    strata = sorted(result["stratum"].unique().to_list())
    total = result.group_by("rule").agg(pl.col("informative", "tokens").sum())
    per = {r: t / max(i, 1) for r, i, t in total.iter_rows()}
    lines = ["tokens per informative group (ratio: plain's / the rule's; above 1 is fewer tokens than plain GRPO)",
             f"{'rule':<11} {'all strata':>18}  " + "  ".join(f"s{i}" for i in range(len(strata)))]
    figures: dict = {}
    for rule in RULES:
        cells = []
        mine = result.filter(pl.col("rule") == rule)
        inf = mine["informative"].sum()
        for i, s in enumerate(strata):
            row = mine.filter(pl.col("stratum") == s).row(0, named=True)
            cells.append(f"{row['tokens'] / max(row['informative'], 1):6.0f} ({row['informative'] / max(inf, 1):.0%})")
            figures[f"informative_share_{rule}_{i}"] = round(row["informative"] / max(inf, 1), 4)
        lines.append(f"{rule:<11} {per[rule]:7.1f} x{per['plain'] / per[rule]:4.2f}     " + "  ".join(cells))
        figures[f"tokens_per_informative_{rule}"] = round(per[rule], 2)
        figures[f"ratio_{rule}"] = round(per["plain"] / per[rule], 4)
    lines += ["cells: tokens per informative group (the stratum's share of the rule's informative groups)",
              *(f"s{i}: {s}" for i, s in enumerate(strata))]
    return lines, figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", default=str(REPO / "benchmarks" / "evidence-v3" / "store"))
    ap.add_argument("--runs", default="ev-uniform-", help="run-id prefix of runs that drew full groups")
    ap.add_argument("--screen-samples", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from storage.query import scan
    from storage.store import Store

    store = Store(a.store)
    runs = pl.col("run_id").str.starts_with(a.runs)
    pool = scan(store, "pool")
    stratum = pl.col("stratum") if "stratum" in pool.collect_schema().names() else pl.lit(None, pl.String)
    strata = pool.filter(runs & (pl.col("round") == 0)).select(
        "run_id", "prompt_id", stratum.fill_null("(no stratum)").alias("stratum")).unique()
    rows = scan(store, "rollouts").filter(runs).select("run_id", "round", "prompt_id", "sample_idx", "reward",
                                                       "n_tokens").join(strata, on=["run_id", "prompt_id"],
                                                                        how="left")
    rows = rows.with_columns(pl.col("stratum").fill_null("(not in round 0's pool)"))  # variants made later
    rows = rows.collect()
    if rows.height == 0:
        print(f"screening_ceiling: no rollouts of runs starting {a.runs!r} in {a.store}", file=sys.stderr)
        return 2
    try:
        groups = screen_kinds(rows, a.screen_samples)
    except ValueError as e:
        print(f"screening_ceiling: {e}", file=sys.stderr)
        return 2
    lines, figures = table(counterfactual(groups))
    runs_n = rows["run_id"].n_unique()
    print(f"{groups.height} full groups of {int(groups['size'][0])} from {runs_n} run(s) {a.runs}* in {a.store}; "
          f"screen = the first {a.screen_samples} samples")
    print("\n".join(lines))
    if a.json:
        figures.update(groups=groups.height, group_size=int(groups["size"][0]), screen_samples=a.screen_samples)
        Path(a.json).write_text(json.dumps(figures, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
