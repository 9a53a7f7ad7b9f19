"""A run's report folder: `write_report` draws the plots (tasks/reporting/plots.py) and `index.html` from the store.

`index.html` embeds the plots beside small tables of the same numbers. A plot whose table has no rows for the
run (a run that never trained has no train_steps) is skipped, and the page says so where the plot would be.

Where it goes: `<store root>/_reports/run_id=<run>/` for a local store. A remote (fsspec) store gets a local
folder, `./refinery-reports/<run>/` under the working directory, because a browser opens local files. The
report is drawn into a hidden folder beside its destination and swapped in by two renames, so a reader sees
the old report, the new one or, for an instant, none; never half of one. `report.json` (MARKER) marks a
folder as a report, which a later `write_report` may replace; any other non-empty folder is refused.
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

from storage.query import connect
from storage.runs import stored_config
from storage.store import Store
from tasks.core.eps import ROUND_OWN_SCORES
from tasks.reporting.plots import (
    PLOT_SOURCES,
    PLOTS,
    bucket_counts,
    calibration_frame,
    calibration_summary,
    score_summary,
    train_summary,
    transitions,
)

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
    "predictions": "SELECT selector, round, prompt_id, predicted_pass_rate FROM predictions WHERE {w}",
    "samples": """SELECT round, prompt_id, sample_idx, reward, correct, augmentation FROM rollouts WHERE {w} UNION ALL
                  SELECT round, prompt_id, sample_idx, reward, correct, augmentation FROM discarded_rollouts
                  WHERE {w}""",
}


def screened_samples(config: dict) -> int:
    """k_s of a run that screened (tasks/sampling/screening.py `screening_applies`), else 0: a stored config
    without the field predates screening, and dapo_filter and `all` generate whole groups whatever it says."""
    from tasks.sampling.screening import screening_applies_to
    from tasks.selectors import REGISTRY

    rollout, name = config.get("rollout", {}), config.get("select", {}).get("selector", "kmeans")
    ks, g = int(rollout.get("screen_samples", 0)), int(rollout.get("group_size", 8))
    return ks if name in REGISTRY and screening_applies_to(ks, g, name) else 0  # an unknown selector: no screening known


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
        screen = screened_samples(stored_config(store, run_id) or {})
        out["calibration"] = calibration_frame(out.pop("predictions"), out.pop("samples"), screen)
        out["runs"] = con.sql("SELECT status, created_at FROM runs WHERE run_id = $run ORDER BY created_at",
                              params={"run": run_id}).pl()
        return out
    finally:
        con.close()


# ---- the page ------------------------------------------------------------------------------------------------
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
        ("Pass-rate model", ["calibration"], table(calibration_summary(f["calibration"]),
                                                   "predicted before generating against observed, per round")),
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
        for name, (key, table, draw) in PLOT_SOURCES.items():
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

