"""Govern stage: before a round generates anything, decide which token-spending components run at their configured
size and which are held at their minimum (the rule and its yields: tasks/core/governor.py) -> `governor`.

It reads the run's earlier rounds only (generated_tokens, prompt_scores, rollouts, discarded_rollouts, shaped_traces,
refinements) and
its own decision for the round before, and lands one row per component: the newest measured round's figures,
the baseline's, the streak, the decision and whether the component is throttled in this round. The flow then
holds each throttled component's config field at its minimum for this round (`held_sections`). Round 0 has
nothing to measure: every component starts at its configured size. With the governor off, nothing is throttled
and the rows say so.
"""

from __future__ import annotations

import polars as pl
import pyarrow as pa

from models.config import Section
from storage.query import scan
from storage.store import Store
from tasks.core.governor import COMPONENTS, Component, GovernorConfig, Measure, decide
from tasks.stage import RoundContext, stage

STAGE_OF = {"lope": ("collect", ("lope",)), "shape": ("shape", None), "refine": ("refine", None)}


def _runs(store: Store, table: str, run_id: str, before: int) -> pl.LazyFrame:
    return scan(store, table).filter((pl.col("run_id") == run_id) & (pl.col("round") < before))


def posterior_topups(store: Store, run_id: str, before: int, screen_samples: int,
                     screened_rounds: set[int]) -> tuple[dict[int, float], dict[int, int], pl.DataFrame]:
    """({round: rows of kept groups topped up on the posterior's word}, {round: their top-up tokens}, and those
    kept groups' (round, prompt_id)) over the screened rounds before `before`. A group topped up on the
    posterior's word is one whose screen (samples 0..k_s-1) was unanimous: kept in `rollouts` when the top-up made it mixed, else in `discarded_rollouts` as
    `zero_variance` (a mixed screen never is). Its cost is its top-up samples' tokens (the screen was spent
    either way)."""
    none = pl.DataFrame(schema={"round": pl.Int32, "prompt_id": pl.String})
    if screen_samples <= 0 or not screened_rounds:
        return {}, {}, none
    in_rounds = pl.col("round").is_in(sorted(screened_rounds))
    kept = _runs(store, "rollouts", run_id, before).filter(in_rounds).select(
        "round", "prompt_id", "sample_idx", "reward", "n_tokens").collect()
    gone = (_runs(store, "discarded_rollouts", run_id, before)
            .filter(in_rounds & (pl.col("reason") == "zero_variance"))
            .select("round", "prompt_id", "sample_idx", "reward", "n_tokens").collect())
    screen = pl.col("sample_idx") < screen_samples
    groups = (pl.concat([kept.with_columns(kept=pl.lit(True)), gone.with_columns(kept=pl.lit(False))])
              .group_by("round", "prompt_id").agg(
                  pl.col("kept").first(), rows=pl.len(),
                  unanimous=pl.col("reward").filter(screen).n_unique() == 1,
                  topup_tokens=pl.col("n_tokens").filter(~screen).sum())
              .filter(pl.col("unanimous")))
    rows = groups.filter(pl.col("kept")).group_by("round").agg(pl.col("rows").sum())
    cost = groups.group_by("round").agg(pl.col("topup_tokens").sum())
    kept = groups.filter(pl.col("kept")).select(pl.col("round").cast(pl.Int32), "prompt_id")
    return dict(rows.iter_rows()), dict(cost.iter_rows()), kept


def measures(store: Store, run_id: str, before: int, screen_samples: int = 0) -> dict[str, dict[int, Measure]]:
    """{component (and "rollout"): {round: Measure}} over the run's rounds before `before`; `screen_samples`:
    the run's k_s (0: no screening, so no posterior top-ups to measure)."""
    tokens = (_runs(store, "generated_tokens", run_id, before)
              .group_by("round", "stage", "purpose").agg(pl.col("tokens").sum()).collect())

    def spent(stage_name: str, purposes: tuple[str, ...] | None) -> dict[int, int]:
        t = tokens.filter(pl.col("stage") == stage_name)
        if purposes is not None:
            t = t.filter(pl.col("purpose").is_in(purposes))
        return dict(t.group_by("round").agg(pl.col("tokens").sum()).iter_rows())

    scored = (_runs(store, "prompt_scores", run_id, before).filter(pl.col("bucket") == "informative")
              .select(pl.col("round").cast(pl.Int32), "prompt_id", "n").collect())
    informative = dict(scored.group_by("round").agg(pl.col("n").sum()).iter_rows())
    replaced = pl.col("augmentation").str.json_path_match("$.lorem_perturb.replaced") == "true"
    rescued = dict(_runs(store, "rollouts", run_id, before).group_by("round", "prompt_id")
                   .agg(rows=pl.len(), rescued=replaced.fill_null(False).any()).filter(pl.col("rescued"))
                   .group_by("round").agg(pl.col("rows").sum()).collect().iter_rows())
    shaped = dict(_runs(store, "shaped_traces", run_id, before).filter(pl.col("correct"))
                  .group_by("round").len().collect().iter_rows())
    accepted = dict(_runs(store, "refinements", run_id, before).filter(pl.col("accepted"))
                    .group_by("round").len().collect().iter_rows())
    screened = {r for r, t in spent("collect", ("screen",)).items() if t > 0}
    topup_rows, topup_cost, topped = posterior_topups(store, run_id, before, screen_samples, screened)
    # the baseline gives back only the top-ups it counted: those scored informative (utility.tau may leave
    # a mixed group out of the bucket)
    topped_informative = dict(scored.join(topped, on=["round", "prompt_id"], how="semi")
                              .group_by("round").agg(pl.col("n").sum()).iter_rows())
    # the baseline pays for every collect token that made its groups: screening samples (`screen`) and the top-ups
    # of mixed screens; the posterior's top-ups are the `topup` component's, so they leave the baseline (rows
    # and tokens), or the component would be measured against itself
    baseline = spent("collect", ("rollout", "screen"))
    base_rows = {r: informative.get(r, 0) - topped_informative.get(r, 0) for r in range(before)}
    base_cost = {r: baseline.get(r, 0) - topup_cost.get(r, 0) for r in range(before)}
    rows = {"rollout": base_rows, "lope": rescued, "shape": shaped, "refine": accepted, "topup": topup_rows}
    cost = {"rollout": base_cost, **{c: spent(*STAGE_OF[c]) for c in STAGE_OF}, "topup": topup_cost}
    return {c: {r: Measure(r, int(cost[c].get(r, 0)), float(rows[c].get(r, 0))) for r in range(before)}
            for c in rows}


def governor_rows(store: Store, run_id: str, round: int) -> pl.DataFrame:
    """The run's `governor` rows of `round` (empty where none landed: the governor off, or an older run)."""
    return scan(store, "governor").filter((pl.col("run_id") == run_id) & (pl.col("round") == round)).collect()


def governed(store: Store, run_id: str, round: int) -> tuple[Component, ...]:
    """The components the run governs in `round`: those of its first governed round before it, else all. A run
    started before a component existed (topup joined later) keeps its own set, so a resume under a newer
    version does not start throttling something the run never measured; a new run governs all of them."""
    landed = scan(store, "governor").filter((pl.col("run_id") == run_id) & (pl.col("round") < round))
    first = landed.filter(pl.col("round") == pl.col("round").min()).select("component").collect()
    if first.height == 0:
        return COMPONENTS
    names = set(first["component"].to_list())
    return tuple(c for c in COMPONENTS if c.name in names)


@stage("govern")
def govern_task(ctx: RoundContext, store: Store, cfg: GovernorConfig, screen_samples: int = 0) -> dict:
    """Decide this round's throttles from the earlier rounds and land them (`screen_samples`: the run's k_s)."""
    previous = governor_rows(store, ctx.run_id, ctx.round - 1) if ctx.round else pl.DataFrame()
    was = dict(previous.select("component", "throttled").iter_rows()) if previous.height else {}
    m = measures(store, ctx.run_id, ctx.round, screen_samples)
    rows = []
    for comp in governed(store, ctx.run_id, ctx.round):
        history = [(m[comp.name][r], m["rollout"][r]) for r in range(ctx.round)]
        if not cfg.enabled or not history:
            throttled, decision, below = False, "off" if not cfg.enabled else "start", 0
        else:
            throttled, decision, below = decide(history, bool(was.get(comp.name, False)), cfg.patience)
        newest = history[-1] if history else None
        rows.append({"run_id": ctx.run_id, "round": ctx.round, "component": comp.name, "field": comp.field,
                     "measured_round": newest[0].round if newest else None,
                     "tokens": newest[0].tokens if newest else None, "rows": newest[0].rows if newest else None,
                     "yield_per_1k": newest[0].yield_per_1k if newest else None,
                     "baseline_per_1k": newest[1].yield_per_1k if newest else None,
                     "below_rounds": below, "throttled": throttled, "decision": decision})
    store.commit("govern", {"governor": pa.Table.from_pylist(rows)}, run_id=ctx.run_id, round=ctx.round)
    return {"throttled": [r["component"] for r in rows if r["throttled"]],
            "decisions": {r["component"]: r["decision"] for r in rows}}


def held_sections(store: Store, run_id: str, round: int, sections: dict[str, Section]) -> dict[str, Section]:
    """`sections` (by config section name) with each throttled component's field held at its minimum for this
    round (never raised above what the config asks)."""
    throttled = set(governor_rows(store, run_id, round).filter(pl.col("throttled"))["component"].to_list())
    out = dict(sections)
    for comp in COMPONENTS:
        section, field = comp.field.split(".")
        if comp.name in throttled and section in out:
            value = min(getattr(out[section], field), comp.minimum)
            out[section] = out[section].model_copy(update={field: value})
    return out
