"""Per-run reports (PNG plots + index.html) and each round's Prefect artifacts (README.md, `refinery run`).

`write_report` draws a run's story from the store:
    pass_rate.png   per-prompt pass rate (prompt_scores.mean_reward), by round
    eps.png         EPS (prompt_scores.eps), by round
    buckets.png     bucket counts per round, and the round r -> r+1 moves of prompts scored in both
    lineage.png     accepted refinement children per round by strategy, and their running total
    eval.png        held-out pass@1 and pass@k by policy version
    train_loss.png  loss and pg_loss (sft_loss, kl when present) over the run's steps, ordered by (round, step)
`index.html` embeds them beside small tables of the same numbers. A plot whose table has no rows for the run
(a run that never trained has no train_steps) is skipped, and the page says so where the plot would be.

Where it goes: `<store root>/_reports/run_id=<run>/` for a local store. A remote (fsspec) store gets a local
folder, `./refinery-reports/<run>/` under the working directory, because a browser opens local files. The
report is drawn into a hidden folder beside its destination and swapped in by two renames, so a reader sees
the old report, the new one or, for an instant, none; never half of one.

Plots use matplotlib's Agg canvas on `Figure` objects, without pyplot: no display, no global figure registry,
safe in Prefect's worker threads and in a process that already uses another backend.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import tempfile
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import polars as pl
from prefect import task

from storage.query import connect
from storage.store import Store
from tasks.reporting import _in_prefect_run, sig4, timed
from tasks.utility import ROUND_OWN_SCORES

BUCKETS = ("informative", "saturated", "too_hard", "flat")
COLOURS = {"informative": "#2a9d8f", "saturated": "#457b9d", "too_hard": "#e63946", "flat": "#adb5bd"}
PLOTS = ("pass_rate", "eps", "buckets", "lineage", "eval", "train_loss")
MARKER = "report.json"  # marks a folder as a report, which write_report may replace

_QUERIES = {
    # the round's own scores: a later rescore (tasks/rescore.py) adds rows of a newer policy_version to a round
    "scores": f"""SELECT round, prompt_id, mean_reward, eps, bucket FROM prompt_scores WHERE {{w}}
                  {ROUND_OWN_SCORES} ORDER BY round, prompt_id""",
    "lineage": """SELECT round, strategy, count(*) FILTER (WHERE accepted) AS accepted, count(*) AS tried
                  FROM refinements WHERE {w} GROUP BY ALL ORDER BY round, strategy""",
    "selections": """SELECT round, cluster, count(*) AS prompts, avg(weight) AS mean_weight
                     FROM selections WHERE {w} GROUP BY ALL ORDER BY round, cluster""",
    "evals": "SELECT round, policy_version, split, n_prompts, k, pass_at_1, pass_at_k FROM evals WHERE {w} "
             "ORDER BY policy_version, round, split",
    "train": "SELECT round, step, policy_version, loss, pg_loss, sft_loss, kl, n_tokens FROM train_steps WHERE {w} "
             "ORDER BY round, step",
}


def run_frames(store: Store, run_id: str, round: int | None = None) -> dict[str, pl.DataFrame]:
    """The rows a report or a round's artifacts are drawn from. Raises ValueError if the run is unknown."""
    con = connect(store)
    try:
        if not con.sql("SELECT count(*) FROM runs WHERE run_id = $run", params={"run": run_id}).fetchall()[0][0]:
            raise ValueError(f"run {run_id!r} is not in the store {store.uri}")
        where, params = "run_id = $run", {"run": run_id}
        if round is not None:
            where, params = where + " AND round = $round", {**params, "round": round}
        out = {name: con.sql(q.format(w=where), params=params).pl() for name, q in _QUERIES.items()}
        out["runs"] = con.sql("SELECT status, created_at FROM runs WHERE run_id = $run ORDER BY created_at",
                              params={"run": run_id}).pl()
        return out
    finally:
        con.close()


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


# plot name -> (frame it is drawn from, what its absence means, plot function)
_PLOT_SOURCES = {
    "pass_rate": ("scores", "prompt_scores", plot_pass_rate),
    "eps": ("scores", "prompt_scores", plot_eps),
    "buckets": ("scores", "prompt_scores", plot_buckets),
    "lineage": ("lineage", "refinements", plot_lineage),
    "eval": ("evals", "evals", plot_eval),
    "train_loss": ("train", "train_steps", plot_train_loss),
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


def _cell(v: Any) -> str:
    if v is None:
        return "–"
    return html.escape(f"{v:.4g}" if isinstance(v, float) else str(v))


def _html_table(df: pl.DataFrame, caption: str) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in df.columns)
    body = "".join("<tr>" + "".join(f"<td>{_cell(v)}</td>" for v in row) + "</tr>" for row in df.iter_rows())
    return f"<table><caption>{html.escape(caption)}</caption><tr>{head}</tr>{body}</table>"


def _page(store: Store, run_id: str, f: dict[str, pl.DataFrame], missing: dict[str, str]) -> str:
    def img(name: str) -> str:
        if name in missing:
            return f'<p class="missing">{name}.png is skipped: {html.escape(missing[name])}.</p>'
        return f'<img src="{name}.png" alt="{name.replace("_", " ")} of run {html.escape(run_id)}">'

    def table(df: pl.DataFrame, caption: str) -> str:
        return _html_table(df, caption) if df.height else ""

    sections = [
        ("Prompt scores", ["pass_rate", "eps"], table(score_summary(f["scores"]), "per round")),
        ("Buckets", ["buckets"], table(bucket_counts(f["scores"]), "prompts per bucket")
         + (table(transitions(f["scores"]), "moves from round r to r+1") if f["scores"].height else "")),
        ("Lineage", ["lineage"], table(f["lineage"], "refinement children (accepted of tried)")),
        ("Selection", [], table(f["selections"], "selected prompts per cluster")
         or '<p class="missing">no selections rows for this run.</p>'),
        ("Evaluation", ["eval"], table(f["evals"], "pass rates by policy version")),
        ("Training", ["train_loss"], table(train_summary(f["train"]), "per round")),
    ]
    status = f["runs"]["status"][-1] if f["runs"].height else "unknown"
    body = "".join(f"<h2>{title}</h2>{''.join(img(n) for n in names)}{tables}" for title, names, tables in sections)
    style = ("body{font-family:sans-serif;max-width:1150px;margin:2em auto;color:#222}img{max-width:100%;"
             "display:block;margin:1em 0}table{border-collapse:collapse;margin:1em 0}caption{text-align:left;"
             "color:#555}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}.missing{color:#a00}")
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>Refinery run {html.escape(run_id)}</title>'
            f"<style>{style}</style></head><body><h1>Run {html.escape(run_id)}</h1><p>status {html.escape(status)}"
            f" · store {html.escape(store.uri)} · drawn {datetime.now(UTC):%Y-%m-%d %H:%M UTC}</p>{body}</body></html>")


# ---- the report folder ----------------------------------------------------------------------------------------
def report_dir(store: Store, run_id: str) -> Path:
    """Where `refinery report` writes by default (see the module docstring)."""
    if store.local:
        return Path(store.root, "_reports", f"run_id={run_id}")
    return Path.cwd() / "refinery-reports" / run_id


def _check_replaceable(dest: Path) -> None:
    if dest.exists() and (not dest.is_dir() or (any(dest.iterdir()) and not (dest / MARKER).exists())):
        raise ValueError(f"{dest} exists and is not a Refinery report (no {MARKER}); choose a new or empty folder")


def _swap_in(tmp: Path, dest: Path) -> None:
    """Replace `dest` by `tmp`: rename the old report aside, rename the new one in, then delete the old."""
    old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
    if dest.exists():
        os.replace(dest, old)
    try:
        os.replace(tmp, dest)
    except OSError:
        if old.exists():
            os.replace(old, dest)
        raise
    shutil.rmtree(old, ignore_errors=True)


def write_report(store: Store, run_id: str, out_dir: str | Path | None = None) -> Path:
    """Draw run `run_id`'s report into `out_dir` (default: `report_dir`) and return that folder.

    An existing folder is replaced only if it is empty or a previous report. Raises ValueError naming the run
    if the store has no such run."""
    frames = run_frames(store, run_id)  # fails on an unknown run before any folder is touched
    dest = Path(out_dir).resolve() if out_dir is not None else report_dir(store, run_id)
    _check_replaceable(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        tmp.chmod(0o755)
        missing = {}
        for name, (key, table, draw) in _PLOT_SOURCES.items():
            if frames[key].height == 0:
                missing[name] = f"the store has no {table} rows for run {run_id}"
                continue
            draw(frames[key]).savefig(tmp / f"{name}.png")
        (tmp / "index.html").write_text(_page(store, run_id, frames, missing), encoding="utf-8")
        plots = [f"{n}.png" for n in PLOTS if n not in missing]
        (tmp / MARKER).write_text(json.dumps({"run_id": run_id, "store": store.uri, "plots": plots,
                                              "skipped": missing, "drawn_at": datetime.now(UTC).isoformat()}))
        with store.lock("report-" + re.sub(r"[^A-Za-z0-9_.-]", "_", str(dest))[-100:]):
            _check_replaceable(dest)
            _swap_in(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing left after a swap; the half-drawn folder after a failure
    return dest


@task(name="report")
@timed
def report_task(store_uri: str, run_id: str, round: int | None = None) -> dict:
    """Redraw the run's report from the store (the flow calls it at the end of every round)."""
    folder = write_report(Store(store_uri), run_id)
    plots = json.loads((folder / MARKER).read_text())["plots"]
    return {"stage": "report", "round": round, "path": str(folder / "index.html"), "plots": plots}


# ---- Prefect artifacts of one round ---------------------------------------------------------------------------
def slug(text: str) -> str:
    """A Prefect artifact key part: lowercase letters, digits and single dashes. A run id that does not map
    one to one (capitals, '_', '.') gets a short hash, so two such ids never share a key.

    >>> slug("run-20261130-0412"), slug("E2E_run.v2"), slug("e2e-run-v2")
    ('run-20261130-0412', 'e2e-run-v2-8ed7d0', 'e2e-run-v2')
    """
    import hashlib

    key = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "run"
    return key if key == text else f"{key}-{hashlib.sha256(text.encode()).hexdigest()[:6]}"


def round_table(store: Store, run_id: str, round: int) -> list[dict]:
    """Rows (section, item, metric, value) of one round: buckets, EPS quantiles, selection per cluster, training
    and evaluation."""
    f = run_frames(store, run_id, round)
    rows: list[dict] = []

    def add(section: str, item: str, metric: str, value: Any) -> None:
        rows.append({"section": section, "item": item, "metric": metric,
                     "value": sig4(value) if isinstance(value, float) else value})

    counts = dict(f["scores"].group_by("bucket").len().iter_rows())
    for b in [*BUCKETS, *sorted(set(counts) - set(BUCKETS))]:
        add("buckets", b, "prompts", counts.get(b, 0))
    for s in score_summary(f["scores"]).iter_rows(named=True):
        add("scores", "all scored prompts", "prompts", s["prompts"])
        add("scores", "all scored prompts", "mean pass rate", s["mean_pass_rate"])
        for q in ("p25", "p50", "p75", "max"):
            add("eps", "all scored prompts", q, s[f"eps_{q}"])
    for c in f["selections"].iter_rows(named=True):
        item = "no cluster" if c["cluster"] is None else f"cluster {c['cluster']}"
        add("selection", item, "prompts", c["prompts"])
        add("selection", item, "mean weight", c["mean_weight"])
    for t in train_summary(f["train"]).iter_rows(named=True):
        for metric in ("steps", "first_loss", "last_loss", "tokens"):
            add("train", f"v{t['policy_version']}", metric.replace("_", " "), t[metric])
    for e in f["evals"].iter_rows(named=True):
        item = f"v{e['policy_version']}" + ("" if e["split"] == "heldout" else f" ({e['split']})")
        add("eval", item, "pass@1", e["pass_at_1"])
        add("eval", item, f"pass@{e['k']}", e["pass_at_k"])
    return rows


def _headline(stage: dict) -> str:
    name = str(stage.get("stage", "?"))
    if "skipped" in stage:
        why = stage.get("skipped")
        return f"- **{name}**: skipped" + (f" ({why})" if isinstance(why, str) else "")
    parts = []
    for k, v in stage.items():
        if k in ("stage", "round", "timing") or isinstance(v, bool):
            continue
        if isinstance(v, int | float):
            parts.append(f"{k} {v:.4g}")
        elif isinstance(v, dict) and v and all(isinstance(x, int | float) for x in v.values()):
            parts.append(f"{k} " + ", ".join(f"{a} {x:.4g}" for a, x in v.items()))
        elif isinstance(v, dict) and v and all(isinstance(x, dict) for x in v.values()):  # e.g. evaluate's versions
            parts += [f"{k} {a}: " + ", ".join(f"{m} {x:.4g}" for m, x in d.items() if isinstance(x, int | float))
                      for a, d in v.items()]
    return f"- **{name}**: " + ("; ".join(parts) or "done")


def round_markdown(run_id: str, round: int, rows: list[dict], stages: list[dict]) -> str:
    lines = [f"# Run `{run_id}`, round {round}", "", "## Stages"]
    lines += [_headline(s) for s in stages if isinstance(s, dict) and s.get("round", round) == round] or ["- none"]
    lines += [f"\nReport (plots and HTML): `{s['path']}`" for s in stages if s.get("stage") == "report" and s.get("path")]
    lines += ["", "## Numbers"]
    groups: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        v = "–" if r["value"] is None else r["value"]
        if r["section"] == "buckets":
            groups.setdefault(("buckets", "(prompts)"), []).append(f"{r['item']} {v}")
        else:
            groups.setdefault((r["section"], r["item"]), []).append(f"{r['metric']} {v}")
    lines += [f"- **{section}** {item}: " + " · ".join(parts) for (section, item), parts in groups.items()]
    return "\n".join(lines) + "\n"


def publish_round_artifacts(store: Store, run_id: str, round: int, stages: list[dict]) -> None:
    """Inside a Prefect flow or task run, publish round `round`'s keyed table (`<run>-round-<r>`) and a markdown
    summary (`<run>-summary`, one version per round); outside one, do nothing."""
    if not _in_prefect_run():
        return
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    rows = round_table(store, run_id, round)
    key = slug(run_id)
    create_table_artifact(key=f"{key}-round-{round}", table=rows,
                          description=f"run {run_id}, round {round}: buckets, EPS, selection, training, evaluation")
    create_markdown_artifact(key=f"{key}-summary", markdown=round_markdown(run_id, round, rows, stages),
                             description=f"run {run_id}: summary of round {round}")
