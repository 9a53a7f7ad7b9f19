"""The pool's per-round status rules (docs/algorithms.md §2): which prompts are active, in reserve, retired.

From the previous round's pool and scores: a non-informative original goes to reserve, a reserve prompt
that scored informative again comes back, a prompt whose ladder child was promoted retires, a soften rung that
was softened further retires (its easier child replaces it), and the children refinement accepted join as
active. The scores are the policy's own samples (tasks/core/eps.py): a
LoPE-rescued group counts as too_hard, so its original moves to reserve rather than staying active on its
replacements.
"""

from __future__ import annotations

import polars as pl


def next_pool(pool: pl.DataFrame, scores: pl.DataFrame, prompts: pl.DataFrame, round: int,
              refinements: pl.DataFrame | None = None) -> pl.DataFrame:
    """Pool membership for `round` from the previous round's pool, scores and refinements.

    - an active original whose bucket is not informative moves to reserve (it is not discarded);
    - a reserve prompt that scored informative (EPS > tau) again is reactivated;
    - accepted refinement children join as active; a promotion retires the easier variant and activates
      the harder one (for the last rung, the original question itself); a `soften` child of a soften rung
      retires that rung (a softened original goes to reserve by the first rule);
    - everything else keeps its status. Prompts without a score keep theirs.
    `prompts` supplies each prompt's transform (only originals go to reserve; rewrites stay active).
    """
    joined = (
        pool.select("prompt_id", "status", "level")
        .join(scores.select("prompt_id", "bucket"), on="prompt_id", how="left")
        .join(prompts.select("prompt_id", "transform"), on="prompt_id", how="left")
    )
    informative = pl.col("bucket") == "informative"
    status = (
        pl.when((pl.col("status") == "active") & pl.col("bucket").is_not_null() & ~informative
                & (pl.col("transform") == "original")).then(pl.lit("reserve"))
        .when((pl.col("status") == "reserve") & informative).then(pl.lit("active"))
        .otherwise(pl.col("status"))
    )
    run_id = pool["run_id"][0] if "run_id" in pool.columns and pool.height else None
    out = joined.select("prompt_id", status.alias("status"), "level")
    if refinements is not None and refinements.height:
        acc = refinements.filter(pl.col("accepted"))
        kinds = prompts.select(pl.col("prompt_id").alias("parent_id"), pl.col("transform").alias("_parent"))
        replaced = acc.join(kinds, on="parent_id", how="left").filter(
            (pl.col("strategy") == "promote") | ((pl.col("strategy") == "soften") & (pl.col("_parent") == "soften")))
        retired = replaced["parent_id"]
        born = acc.select("child_id").unique()
        out = out.with_columns(status=pl.when(pl.col("prompt_id").is_in(retired.implode())).then(pl.lit("retired"))
                               .when(pl.col("prompt_id").is_in(born["child_id"].implode())).then(pl.lit("active"))
                               .otherwise(pl.col("status")))
        new = born.join(out, left_on="child_id", right_on="prompt_id", how="anti").select(
            pl.col("child_id").alias("prompt_id"), pl.lit("active").alias("status"),
            pl.lit(None, pl.String).alias("level"))
        out = pl.concat([out, new], how="vertical_relaxed")
    levels = prompts.select("prompt_id", pl.col("transform").alias("_t"))
    out = out.join(levels, on="prompt_id", how="left").with_columns(
        level=pl.when(pl.col("_t").is_in(["mcq4", "mcq10", "cloze"])).then(pl.col("_t")).otherwise(pl.col("level")))
    return out.select(
        pl.lit(run_id, pl.String).alias("run_id"), pl.lit(round, pl.Int32).alias("round"), "prompt_id",
        "status", "level",
    ).sort("prompt_id")
