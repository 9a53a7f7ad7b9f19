"""The Prefect side of reporting: the `report` stage task and each round's Prefect artifacts.

- `report_task` redraws the run's report folder (tasks/reporting/page.py: PNG plots from tasks/reporting/plots.py and
  index.html) at the end of every round, and returns where it is. It is a stage (tasks/stage.py) that commits
  nothing, so it never counts as landed: a resumed round redraws it, and the page shows the run so far.
- `publish_round_artifacts`, inside a Prefect flow or task run, publishes round r's keyed table
  (`<run>-round-<r>`: buckets, EPS quantiles, selection per cluster, training, evaluation) and a markdown
  summary (`<run>-summary`, one version per round) of the round's stages and numbers; outside one it does
  nothing. Artifact keys are `slug`s of the run id.

The page and plot names stay importable from here (`run_frames`, `PLOTS`, ...), where callers import them.
`write_report` here is tasks/reporting/page.py's, refusing an `out_dir` (`refinery report --out`) in the store's own
folders (`_landed/`, `.tmp/`, `.locks/`, `.prefect/`, a table's) or the store's root: files there would be read
as the store's (every command then warned of stray files under `_landed/`). `_reports/`, the default, is allowed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from storage.schemas import TABLES
from storage.store import Store
from tasks.core.ids import TAG_HEX, digest
from tasks.interop.export_run import in_store
from tasks.reporting import page as report_page
from tasks.reporting.page import MARKER, report_dir, run_frames
from tasks.reporting.plots import BUCKETS, PLOTS, score_summary, train_summary
from tasks.reporting.progress import in_prefect_run, sig4
from tasks.reporting.summary import stage_lines
from tasks.stage import RoundContext, stage

__all__ = ["BUCKETS", "MARKER", "PLOTS", "publish_round_artifacts", "report_dir", "report_task", "round_markdown",
           "round_table", "run_frames", "slug", "write_report"]


STORE_FOLDERS = ("_landed", ".tmp", ".locks", ".prefect", *TABLES)  # what the store itself reads and writes


def write_report(store: Store, run_id: str, out_dir: str | Path | None = None) -> Path:
    """tasks/reporting/page.py `write_report`, with an `out_dir` inside the store's own folders refused before
    anything is drawn (module docstring)."""
    if out_dir is not None:
        rel = in_store(store, Path(out_dir))
        if rel is not None and (not rel.parts or rel.parts[0] in STORE_FOLDERS):
            where = f"inside the store {store.uri}, in its {rel.parts[0]}/ folder" if rel.parts else \
                f"the store {store.uri} itself"
            raise ValueError(f"--out {out_dir} is {where}, where the store keeps its own files; write the report "
                             f"elsewhere, or leave --out out for {report_dir(store, run_id)}")
    return report_page.write_report(store, run_id, out_dir)


@stage("report")
def report_task(ctx: RoundContext, store: Store) -> dict:
    """Redraw the run's report from the store (the flow calls it at the end of every round)."""
    folder = write_report(store, ctx.run_id)
    plots = json.loads((folder / MARKER).read_text())["plots"]
    return {"path": str(folder / "index.html"), "plots": plots}


# ---- Prefect artifacts of one round ---------------------------------------------------------------------------
def slug(text: str) -> str:
    """A Prefect artifact key part: lowercase letters, digits and single dashes. A run id that does not map
    one to one (capitals, '_', '.') gets a short hash, so two such ids never share a key.

    >>> slug("run-20261130-0412"), slug("E2E_run.v2"), slug("e2e-run-v2")
    ('run-20261130-0412', 'e2e-run-v2-8ed7d0', 'e2e-run-v2')
    """

    key = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "run"
    return key if key == text else f"{key}-{digest(text, TAG_HEX)}"


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
    """A stage's markdown line: its sentences, or its numbers (tasks/reporting/summary.py, as `refinery run`)."""
    return f"- **{stage.get('stage', '?')}**: " + "; ".join(stage_lines(stage, every=True))


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
    if not in_prefect_run():
        return
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    rows = round_table(store, run_id, round)
    key = slug(run_id)
    create_table_artifact(key=f"{key}-round-{round}", table=rows,
                          description=f"run {run_id}, round {round}: buckets, EPS, selection, training, evaluation")
    create_markdown_artifact(key=f"{key}-summary", markdown=round_markdown(run_id, round, rows, stages),
                             description=f"run {run_id}: summary of round {round}")
