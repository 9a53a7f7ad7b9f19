"""A run's numbers and their plots: the summaries a report and a round's artifacts show, and one PNG per story.

    pass_rate.png   per-prompt pass rate (prompt_scores.mean_reward), by round
    eps.png         EPS (prompt_scores.eps), by round
    buckets.png     bucket counts per round, and the round r -> r+1 moves of prompts scored in both
    lineage.png     accepted refinement children per round by strategy, and their running total
    eval.png        held-out pass@1 and pass@k by policy version
    train_loss.png  loss and pg_loss (sft_loss, kl when present) over the run's steps, ordered by (round, step)
    calibration.png the pass-rate model's calibration: its predicted pass rate (`predictions`, made before the
                    round generated anything) against the pass rate the prompt's own samples of that round then
                    showed, by decile of the prediction, one line per predictor (`screening`, `thompson`)

Each plot takes its frame (non-empty, from `tasks.reporting.page.run_frames`) and returns a Figure; `PLOT_SOURCES`
says which frame each is drawn from and which table's absence skips it. Plots use matplotlib's Agg canvas on
`Figure` objects, without pyplot: no display, no global figure registry, safe in Prefect's worker threads and
in a process that already uses another backend.
"""

from __future__ import annotations

import polars as pl

from tasks.core.passrate import pass_counts

BUCKETS = ("informative", "saturated", "too_hard", "flat")
COLOURS = {"informative": "#2a9d8f", "saturated": "#457b9d", "too_hard": "#e63946", "flat": "#adb5bd"}
PLOTS = ("pass_rate", "eps", "buckets", "lineage", "eval", "train_loss", "calibration")
DECILES = 10


# ---- plots: each takes its frame (non-empty) and returns a Figure ---------------------------------------------
def _figure(ncols: int = 1, width: float = 8.0):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(1, ncols, squeeze=False)[0]


def _by_round(scores: pl.DataFrame, column: str, label: str):
    fig, (ax,) = _figure()
    rounds = sorted(scores["round"].unique())
    values = [scores.filter(pl.col("round") == r)[column].drop_nulls().to_list() for r in rounds]
    ax.boxplot(values, positions=rounds, widths=0.5, showmeans=True)
    for r, v in zip(rounds, values):  # the points beside the boxes, spread by a fixed (golden-ratio) jitter
        ax.scatter([r + (i * 0.618034 % 1 - 0.5) * 0.3 for i in range(len(v))], v, s=14, alpha=0.55,
                   color="#457b9d", zorder=3)
    ax.set(xticks=rounds, xlabel="round", ylabel=label, title=f"{label} per prompt, by round")
    return fig


def plot_pass_rate(scores: pl.DataFrame):
    return _by_round(scores, "mean_reward", "pass rate")


def plot_eps(scores: pl.DataFrame):
    return _by_round(scores, "eps", "EPS")


def bucket_counts(scores: pl.DataFrame) -> pl.DataFrame:
    """Prompts per (round, bucket), one column per bucket seen (known ones first), zeros filled."""
    wide = scores.pivot(on="bucket", index="round", values="prompt_id", aggregate_function="len").sort("round")
    names = [b for b in BUCKETS if b in wide.columns] + sorted(set(wide.columns) - {"round", *BUCKETS})
    return wide.select("round", *names).fill_null(0)


def transitions(scores: pl.DataFrame) -> pl.DataFrame:
    """(from, to, prompts): bucket in round r -> bucket in round r+1, over prompts scored in both, all r."""
    a = scores.select("round", "prompt_id", pl.col("bucket").alias("from"))
    b = scores.select((pl.col("round") - 1).alias("round"), "prompt_id", pl.col("bucket").alias("to"))
    return a.join(b, on=["round", "prompt_id"]).group_by("from", "to").len("prompts").sort("from", "to")


def plot_buckets(scores: pl.DataFrame):
    counts, moves = bucket_counts(scores), transitions(scores)
    fig, axes = _figure(2 if moves.height else 1, 11.0 if moves.height else 8.0)
    ax, bottom = axes[0], [0] * counts.height
    for b in counts.columns[1:]:
        ax.bar(counts["round"], counts[b], bottom=bottom, label=b, color=COLOURS.get(b))
        bottom = [x + y for x, y in zip(bottom, counts[b])]
    ax.set(xticks=counts["round"].to_list(), xlabel="round", ylabel="prompts", title="buckets per round")
    ax.legend(fontsize="small")
    if moves.height:
        names = counts.columns[1:]
        grid = [[0] * len(names) for _ in names]
        for f, t, n in moves.iter_rows():
            grid[names.index(f)][names.index(t)] = n
        m = axes[1]
        m.imshow(grid, cmap="Blues", vmin=0)
        top = max(map(max, grid))
        for i, row in enumerate(grid):
            for j, n in enumerate(row):
                m.text(j, i, str(n), ha="center", va="center", color="white" if n > top / 2 else "black")
        m.set(xticks=range(len(names)), yticks=range(len(names)), xlabel="bucket in round r+1",
              ylabel="bucket in round r", title="moves r -> r+1 (prompts scored in both)")
        m.set_xticklabels(names, rotation=20)
        m.set_yticklabels(names)
    return fig


def plot_lineage(lineage: pl.DataFrame):
    fig, (ax,) = _figure()
    wide = lineage.pivot(on="strategy", index="round", values="accepted").sort("round").fill_null(0)
    bottom = [0] * wide.height
    for s in wide.columns[1:]:
        ax.bar(wide["round"], wide[s], bottom=bottom, label=s)
        bottom = [x + y for x, y in zip(bottom, wide[s])]
    total = [sum(bottom[: i + 1]) for i in range(len(bottom))]
    ax.plot(wide["round"], total, "k--o", label="running total")
    ax.set(xticks=wide["round"].to_list(), xlabel="round", ylabel="accepted children",
           title="lineage growth: accepted refinement children by strategy")
    ax.legend(fontsize="small")
    return fig


def plot_eval(evals: pl.DataFrame):
    fig, (ax,) = _figure()
    held = evals.filter(pl.col("split") == "heldout")
    held = held if held.height else evals
    k = held["k"].max()
    ax.plot(held["policy_version"], held["pass_at_1"], "o-", label="pass@1")
    ax.plot(held["policy_version"], held["pass_at_k"], "s-", label=f"pass@{k}")
    ax.set(xticks=held["policy_version"].to_list(), ylim=(-0.03, 1.03), xlabel="policy version",
           ylabel="held-out pass rate", title=f"evaluation ({held['split'][0]}, {held['n_prompts'].max()} prompts)")
    ax.legend(fontsize="small")
    return fig


def plot_train_loss(train: pl.DataFrame):
    has_kl = train["kl"].drop_nulls().len() > 0
    fig, axes = _figure(2 if has_kl else 1, 11.0 if has_kl else 8.0)
    x = list(range(train.height))
    for col in ("loss", "pg_loss", "sft_loss"):
        if train[col].drop_nulls().len():
            axes[0].plot(x, train[col], label=col, lw=1.2)
    if has_kl:
        axes[1].plot(x, train["kl"], color="#e76f51", lw=1.2)
        axes[1].set(xlabel="step (all rounds)", ylabel="kl", title="KL to the reference")
    starts = train.with_row_index().group_by("round").agg(pl.col("index").min()).sort("round")
    for ax in axes:
        for r, i in starts.iter_rows():
            ax.axvline(i, color="grey", ls=":", lw=0.8)
            ax.text(i, 1, f" r{r}", transform=ax.get_xaxis_transform(), va="top", fontsize="small", color="grey")
    axes[0].set(xlabel="step (all rounds)", ylabel="loss", title="training loss")
    axes[0].legend(fontsize="small")
    return fig


def calibration_frame(predictions: pl.DataFrame, samples: pl.DataFrame, screen_samples: int = 0) -> pl.DataFrame:
    """(selector, round, prompt_id, predicted_pass_rate, successes, failures): each prediction beside the round's
    own unassisted samples of its prompt (rollouts and discarded_rollouts: a screened-out screen counts; LoPE
    replacements count as the failure they displaced, few-shot-assisted samples not at all, as the model's own
    counts do: tasks/core/passrate.py `pass_counts`). Predictions whose prompt got no own sample are left out.
    A screening run (`screen_samples` k_s > 0) is read on its screens only, sample_idx < k_s: top-ups go to the
    prompts whose screen was mixed, so counting them would weight each prompt by what its screen showed."""
    empty = pl.DataFrame(schema={"selector": pl.String, "round": pl.Int32, "prompt_id": pl.String,
                                 "predicted_pass_rate": pl.Float64, "successes": pl.Int64, "failures": pl.Int64})
    if predictions.height == 0 or samples.height == 0:
        return empty
    if screen_samples > 0:
        samples = samples.filter(pl.col("sample_idx") < screen_samples)
        if samples.height == 0:
            return empty
    counts = pl.concat([pass_counts(samples.filter(pl.col("round") == r)).with_columns(pl.lit(r, pl.Int32).alias("round"))
                        for r in samples["round"].unique().sort()])
    return (predictions.select("selector", pl.col("round").cast(pl.Int32), "prompt_id", "predicted_pass_rate")
            .join(counts.with_columns(pl.col("successes", "failures").cast(pl.Int64)), on=["round", "prompt_id"])
            .filter(pl.col("successes") + pl.col("failures") > 0).sort("selector", "round", "prompt_id"))


def _deciles(cal: pl.DataFrame) -> pl.DataFrame:
    n = pl.col("successes") + pl.col("failures")
    return (cal.with_columns(decile=(pl.col("predicted_pass_rate") * DECILES).floor().clip(0, DECILES - 1).cast(pl.Int32),
                             n=n)
            .group_by("selector", "decile").agg(
                prompts=pl.len(), samples=pl.col("n").sum(),
                predicted=(pl.col("predicted_pass_rate") * pl.col("n")).sum() / pl.col("n").sum(),
                observed=pl.col("successes").sum() / pl.col("n").sum())
            .sort("selector", "decile"))


def calibration_summary(cal: pl.DataFrame) -> pl.DataFrame:
    """Per (selector, round): prompts, own samples, the sample-weighted mean predicted pass rate, the observed pass
    rate, and the expected calibration error (the sample-weighted mean |predicted - observed| over deciles of
    the prediction; 0 is perfectly calibrated)."""
    if cal.height == 0:
        return pl.DataFrame()
    rows = []
    for (sel, rnd), part in cal.group_by("selector", "round", maintain_order=True):
        d = _deciles(part)
        total = d["samples"].sum()
        rows.append({"selector": sel, "round": rnd, "prompts": part.height, "samples": total,
                     "predicted": float((d["predicted"] * d["samples"]).sum() / total),
                     "observed": float((d["observed"] * d["samples"]).sum() / total),
                     "calibration_error": float(((d["predicted"] - d["observed"]).abs() * d["samples"]).sum() / total)})
    return pl.DataFrame(rows).sort("selector", "round")


def plot_calibration(cal: pl.DataFrame):
    fig, (ax,) = _figure()
    ax.plot([0, 1], [0, 1], color="grey", ls=":", lw=1, label="perfectly calibrated")
    d = _deciles(cal)
    for (sel,), part in d.group_by("selector", maintain_order=True):
        sizes = (part["samples"] / part["samples"].max() * 120 + 12).to_list()
        ax.plot(part["predicted"], part["observed"], "-", lw=1, alpha=0.7)
        ax.scatter(part["predicted"], part["observed"], s=sizes, alpha=0.8, zorder=3,
                   label=f"{sel} ({int(part['samples'].sum())} samples)")
    rounds = cal["round"].unique().sort().to_list()
    ax.set(xlim=(-0.02, 1.02), ylim=(-0.02, 1.02), xlabel="predicted pass rate (before generating)",
           ylabel="observed pass rate (own samples)",
           title=f"pass-rate model calibration, rounds {rounds[0]}-{rounds[-1]} (point size: samples)")
    ax.legend(fontsize="small")
    return fig


# plot name -> (frame it is drawn from, what its absence means, plot function)
PLOT_SOURCES = {
    "pass_rate": ("scores", "prompt_scores", plot_pass_rate),
    "eps": ("scores", "prompt_scores", plot_eps),
    "buckets": ("scores", "prompt_scores", plot_buckets),
    "lineage": ("lineage", "refinements", plot_lineage),
    "eval": ("evals", "evals", plot_eval),
    "train_loss": ("train", "train_steps", plot_train_loss),
    "calibration": ("calibration", "predictions", plot_calibration),
}


# ---- the numbers beside the plots ---------------------------------------------------------------------------
def score_summary(scores: pl.DataFrame) -> pl.DataFrame:
    """Per round: prompts scored, mean pass rate, EPS quantiles (linear, like DuckDB's quantile_cont)."""
    eps = pl.col("eps")
    return scores.group_by("round").agg(
        prompts=pl.len(), mean_pass_rate=pl.col("mean_reward").mean(), eps_p25=eps.quantile(0.25, "linear"),
        eps_p50=eps.quantile(0.5, "linear"), eps_p75=eps.quantile(0.75, "linear"), eps_max=eps.max()).sort("round")


def train_summary(train: pl.DataFrame) -> pl.DataFrame:
    """Per round and trained version: steps, first and last loss, tokens."""
    loss = pl.col("loss").sort_by("step")
    return train.group_by("round", "policy_version").agg(
        steps=pl.len(), first_loss=loss.first(), last_loss=loss.last(), tokens=pl.col("n_tokens").sum()
    ).sort("round", "policy_version")
