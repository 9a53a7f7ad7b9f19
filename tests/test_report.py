"""Per-run reports and per-round artifacts, checked against SQL over the store they are drawn from.

Two stores: a real two-round run of the tiny model (what the pipeline actually writes; it never trains, so
its report must skip the loss plot), and a hand-made three-round run with every table filled and varied
numbers, so that each plot's bars, points and lines can be compared with the rows behind them.
"""

import contextlib
import io
import json
import re
import sys
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pytest
from conftest import q
from PIL import Image

from storage.store import Store
from tasks.report import PLOTS, publish_round_artifacts, round_table, run_frames, slug, write_report
from tasks.reporting import plots as report_plots

sys.path.insert(0, str(Path(__file__).parent))
from test_curriculum import TINY  # noqa: E402

SYN = "Syn_Run.1"  # not a valid artifact key as it is: slug() makes it syn-run-1-<hash>
TABLE_OF_PLOT = {"pass_rate": "prompt_scores", "eps": "prompt_scores", "buckets": "prompt_scores",
                 "lineage": "refinements", "eval": "evals", "train_loss": "train_steps", "calibration": "predictions"}


@pytest.fixture(scope="module")
def tiny_run(prefect_api, tmp_path_factory):
    from flows.config import load_config
    from flows.curriculum import curriculum

    store = Store(tmp_path_factory.mktemp("tiny") / "store")
    curriculum(load_config(sets=TINY, run_id="rep", store=store.root, rounds=2))
    return store


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Store:
    """Three rounds of made-up but well-formed rows in every table a report reads."""
    store = Store(tmp_path_factory.mktemp("syn") / "store")
    rng = np.random.default_rng(7)
    now = datetime(2026, 1, 1, tzinfo=UTC)
    store.commit("running-0", {"runs": pa.table({"run_id": [SYN], "created_at": [now], "status": ["running"],
                                                 "config": ["{}"]})}, run_id=SYN)
    for r in range(3):
        ids = [f"p{i:02d}" for i in range(3 * r, 20)]  # later rounds score fewer prompts: migration sees a subset
        reward = rng.uniform(0, 1, len(ids)).round(2)
        bucket = rng.choice(["informative", "saturated", "too_hard", "flat"], len(ids), p=[0.5, 0.2, 0.2, 0.1])
        strategies = ["ladder", "teacher_scaffold", "rephrase"][: r + 1]
        n_ref = 4 + 3 * r
        steps = 5 + r
        tables = {
            "prompt_scores": pa.table({"run_id": [SYN] * len(ids), "round": [r] * len(ids), "policy_version": [r] * len(ids),
                                       "prompt_id": ids, "n": [8] * len(ids), "mean_reward": reward,
                                       "std_reward": rng.uniform(0, 0.5, len(ids)), "eps": rng.gamma(2, 0.1, len(ids)),
                                       "bucket": bucket}),
            "refinements": pa.table({"run_id": [SYN] * n_ref, "round": [r] * n_ref,
                                     "parent_id": [f"p{i:02d}" for i in range(n_ref)],
                                     "child_id": [f"c{r}{i}" for i in range(n_ref)],
                                     "strategy": [strategies[i % len(strategies)] for i in range(n_ref)],
                                     "accepted": rng.uniform(0, 1, n_ref) < 0.7}),
            "selections": pa.table({"run_id": [SYN] * 9, "round": [r] * 9, "prompt_id": ids[:9],
                                    "selector": ["kmeans"] * 9, "cluster": pa.array([i % 3 for i in range(9)], pa.int32()),
                                    "weight": rng.uniform(0.1, 0.9, 9)}),
            "train_steps": pa.table({"run_id": [SYN] * steps, "round": [r] * steps, "step": list(range(steps)),
                                     "policy_version": [r + 1] * steps,
                                     "loss": (1.0 / (1 + r + np.arange(steps)) + rng.normal(0, 0.02, steps)),
                                     "pg_loss": rng.normal(0, 0.1, steps), "kl": rng.uniform(0, 0.05, steps),
                                     "n_tokens": pa.array(rng.integers(100, 200, steps), pa.int64()),
                                     "seconds": [0.5] * steps}),
            "evals": pa.table({"run_id": [SYN] * (2 if r == 0 else 1), "round": [r] * (2 if r == 0 else 1),
                               "policy_version": [0, 1] if r == 0 else [r + 1], "split": ["heldout"] * (2 if r == 0 else 1),
                               "n_prompts": [10] * (2 if r == 0 else 1), "k": [4] * (2 if r == 0 else 1),
                               "pass_at_1": rng.uniform(0, 0.5, 2 if r == 0 else 1),
                               "pass_at_k": rng.uniform(0.5, 1, 2 if r == 0 else 1)}),
        }
        # the pass-rate model's predictions for 12 prompts, and 4 own samples of each with a pass rate near them
        p = rng.uniform(0, 1, 12)
        tables["predictions"] = pa.table({
            "run_id": [SYN] * 12, "round": pa.array([r] * 12, pa.int32()), "prompt_id": ids[:12],
            "selector": ["screening"] * 12, "bin": ["b"] * 12, "alpha": p * 8 + 1, "beta": (1 - p) * 8 + 1,
            "predicted_pass_rate": p, "predicted_informative": p * (1 - p) * 4, "draw": [None] * 12,
            "picked": [True] * 12})
        ok = [bool(x) for x in (rng.uniform(0, 1, 48) < np.repeat(p, 4))]
        tables["rollouts"] = pa.table({
            "run_id": [SYN] * 48, "round": pa.array([r] * 48, pa.int32()), "policy_version": [r] * 48,
            "prompt_id": [i for i in ids[:12] for _ in range(4)], "sample_idx": list(range(4)) * 12,
            "prompt_text": ["q"] * 48, "completion": ["a"] * 48, "reward": [float(x) for x in ok], "correct": ok,
            "n_tokens": [3] * 48, "mean_logprob": [-1.0] * 48, "finish_reason": ["stop"] * 48})
        store.commit("synthetic", tables, run_id=SYN, round=r)
    return store



def check_png(path: Path) -> None:
    """A real, non-blank plot: a PNG of a sensible size with coloured marks (data) on it, not just axes."""
    with Image.open(path) as im:
        assert im.format == "PNG" and im.width > 200 and im.height > 150, (path, im.format, im.size)
        rgb = np.asarray(im.convert("RGB")).astype(int)
    colours = len(np.unique(rgb.reshape(-1, 3), axis=0))
    coloured = int(((rgb.max(axis=2) - rgb.min(axis=2)) > 60).sum())  # blank axes and text are all grey
    assert colours > 10 and rgb.std() > 10 and coloured > 300, (path, colours, rgb.std(), coloured)


def check_folder(folder: Path, expected: set[str]) -> str:
    """Exactly the expected plots, each a real PNG referenced by index.html; the others noted as skipped."""
    page = (folder / "index.html").read_text()
    assert {p.stem for p in folder.glob("*.png")} == expected
    assert set(re.findall(r'<img src="([^"]+)"', page)) == {f"{n}.png" for n in expected}
    for name in expected:
        check_png(folder / f"{name}.png")
    for name in set(PLOTS) - expected:
        assert f"{name}.png is skipped: the store has no {TABLE_OF_PLOT[name]} rows" in page
    meta = json.loads((folder / "report.json").read_text())
    assert sorted(meta["plots"]) == sorted(f"{n}.png" for n in expected)
    return page


def test_report_of_a_real_run_plots_what_the_store_holds(tiny_run):
    store = tiny_run
    folder = write_report(store, "rep")
    assert folder == Path(store.root, "_reports", "run_id=rep")
    rows = {t: q(store, f"SELECT count(*) AS n FROM {t} WHERE run_id = 'rep'")[0]["n"] for t in set(TABLE_OF_PLOT.values())}
    assert rows["prompt_scores"] > 0 and rows["evals"] > 0
    page = check_folder(folder, {p for p in PLOTS if rows[TABLE_OF_PLOT[p]]})
    bucket_table = re.search(r"<caption>prompts per bucket</caption>(.*?)</table>", page).group(1)
    assert bucket_table.count("<tr>") - 1 == q(store, "SELECT count(DISTINCT round) AS n FROM prompt_scores "
                                                      "WHERE run_id = 'rep'")[0]["n"] == 2


def test_cli_report(tiny_run, tmp_path):
    from flows.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["report", "rep", "--store", tiny_run.root]) == 0
    assert out.getvalue().strip() == str(Path(tiny_run.root, "_reports", "run_id=rep", "index.html"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["report", "rep", "--store", tiny_run.root, "--out", str(tmp_path / "elsewhere")]) == 0
    assert Path(out.getvalue().strip()) == tmp_path / "elsewhere" / "index.html"
    assert (tmp_path / "elsewhere" / "index.html").is_file()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["report", "no-such-run", "--store", tiny_run.root]) == 1
    assert "run 'no-such-run' is not in the store" in err.getvalue() and len(err.getvalue().splitlines()) == 1
    # --out never replaces a folder that is not a report
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert main(["report", "rep", "--store", tiny_run.root, "--out", str(tmp_path / "mine")]) == 1
    assert "is not a Refinery report" in err.getvalue() and (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_every_plot_of_a_full_run_and_the_swap(synthetic, monkeypatch):
    folder = write_report(synthetic, SYN)
    check_folder(folder, set(PLOTS))
    # a redraw replaces the whole folder and leaves nothing behind beside it
    (folder / "stale.txt").write_text("from an older report")
    assert write_report(synthetic, SYN) == folder and not (folder / "stale.txt").exists()
    assert [p.name for p in folder.parent.iterdir()] == [f"run_id={SYN}"]
    # a redraw that fails half-way leaves the previous report as it was
    before = (folder / "report.json").read_text()

    def broken(frame):
        raise RuntimeError("disk full")

    monkeypatch.setitem(report_plots.PLOT_SOURCES, "eval", ("evals", "evals", broken))
    with pytest.raises(RuntimeError, match="disk full"):
        write_report(synthetic, SYN)
    assert (folder / "report.json").read_text() == before
    assert [p.name for p in folder.parent.iterdir()] == [f"run_id={SYN}"]


def test_plots_draw_the_rows_behind_them(synthetic):
    f = run_frames(synthetic, SYN)
    rounds = [r["round"] for r in q(synthetic, f"SELECT DISTINCT round FROM prompt_scores WHERE run_id = '{SYN}' ORDER BY 1")]
    assert rounds == [0, 1, 2]

    ax = report_plots.plot_pass_rate(f["scores"]).axes[0]
    assert list(ax.get_xticks()) == rounds
    points = np.concatenate([c.get_offsets()[:, 1] for c in ax.collections])
    rewards = q(synthetic, f"SELECT mean_reward FROM prompt_scores WHERE run_id = '{SYN}' ORDER BY round, prompt_id")
    assert points.tolist() == [r["mean_reward"] for r in rewards]

    fig = report_plots.plot_buckets(f["scores"])
    bars = {c.get_label(): [p.get_height() for p in c.patches] for c in fig.axes[0].containers}
    counts = q(synthetic, f"SELECT round, bucket, count(*) AS n FROM prompt_scores WHERE run_id = '{SYN}' GROUP BY ALL")
    assert set(bars) == {c["bucket"] for c in counts}
    for bucket, heights in bars.items():
        assert len(heights) == len(rounds)
        assert heights == [sum(c["n"] for c in counts if c["bucket"] == bucket and c["round"] == r) for r in rounds]
    moved = q(synthetic, f"""SELECT count(*) AS n FROM prompt_scores a JOIN prompt_scores b
                            ON a.prompt_id = b.prompt_id AND b.round = a.round + 1
                            WHERE a.run_id = '{SYN}' AND b.run_id = '{SYN}'""")[0]["n"]
    assert sum(int(t.get_text()) for t in fig.axes[1].texts) == moved == 17 + 14

    ax = report_plots.plot_lineage(f["lineage"]).axes[0]
    accepted = q(synthetic, f"SELECT round, strategy, count(*) AS n FROM refinements WHERE run_id = '{SYN}' AND accepted "
                            "GROUP BY ALL")
    for c in ax.containers:
        assert [p.get_height() for p in c.patches] == [
            sum(a["n"] for a in accepted if a["strategy"] == c.get_label() and a["round"] == r) for r in rounds]
    running = next(line for line in ax.lines if line.get_label() == "running total")
    assert running.get_ydata()[-1] == sum(a["n"] for a in accepted) > 0

    ax = report_plots.plot_eval(f["evals"]).axes[0]
    evals = q(synthetic, f"SELECT policy_version, pass_at_1, pass_at_k FROM evals WHERE run_id = '{SYN}' "
                         "AND split = 'heldout' ORDER BY policy_version")
    lines = {line.get_label(): line for line in ax.lines}
    assert list(lines["pass@1"].get_xdata()) == [e["policy_version"] for e in evals] == [0, 1, 2, 3]
    assert list(lines["pass@1"].get_ydata()) == [e["pass_at_1"] for e in evals]
    assert list(lines["pass@4"].get_ydata()) == [e["pass_at_k"] for e in evals]

    fig = report_plots.plot_train_loss(f["train"])
    loss = [r["loss"] for r in q(synthetic, f"SELECT loss FROM train_steps WHERE run_id = '{SYN}' ORDER BY round, step")]
    lines = {line.get_label(): line for line in fig.axes[0].lines}
    assert list(lines["loss"].get_ydata()) == loss and len(loss) == 5 + 6 + 7
    assert "sft_loss" not in lines and len(fig.axes) == 2  # no SFT rows; kl has its own panel


def test_round_table_matches_sql(synthetic):
    rows = round_table(synthetic, SYN, 1)
    got = {(r["section"], r["item"], r["metric"]): r["value"] for r in rows}
    counts = {r["bucket"]: r["n"] for r in q(synthetic, f"SELECT bucket, count(*) AS n FROM prompt_scores "
                                                        f"WHERE run_id = '{SYN}' AND round = 1 GROUP BY 1")}
    assert {k[1]: v for k, v in got.items() if k[0] == "buckets"} == {
        b: counts.get(b, 0) for b in ("informative", "saturated", "too_hard", "flat")}
    eps = q(synthetic, f"""SELECT quantile_cont(eps, 0.25) AS p25, median(eps) AS p50, quantile_cont(eps, 0.75) AS p75,
                          max(eps) AS max FROM prompt_scores WHERE run_id = '{SYN}' AND round = 1""")[0]
    for name, value in eps.items():
        assert got[("eps", "all scored prompts", name)] == pytest.approx(value, rel=1e-3)
    clusters = q(synthetic, f"SELECT cluster, count(*) AS n, avg(weight) AS w FROM selections WHERE run_id = '{SYN}' "
                            "AND round = 1 GROUP BY 1")
    assert len(clusters) == 3
    for c in clusters:
        assert got[("selection", f"cluster {c['cluster']}", "prompts")] == c["n"]
        assert got[("selection", f"cluster {c['cluster']}", "mean weight")] == pytest.approx(c["w"], rel=1e-3)
    train = q(synthetic, f"""SELECT count(*) AS steps, arg_min(loss, step) AS first, arg_max(loss, step) AS last,
                            sum(n_tokens) AS tokens FROM train_steps WHERE run_id = '{SYN}' AND round = 1""")[0]
    assert got[("train", "v2", "steps")] == train["steps"] == 6
    assert got[("train", "v2", "first loss")] == pytest.approx(train["first"], rel=1e-3)
    assert got[("train", "v2", "last loss")] == pytest.approx(train["last"], rel=1e-3)
    assert got[("train", "v2", "tokens")] == train["tokens"]
    assert {k for k in got if k[0] == "eval"} == {("eval", "v2", "pass@1"), ("eval", "v2", "pass@4")}


def test_round_artifacts_are_published_inside_a_flow_only(prefect_api, synthetic):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    stages = [{"stage": "collect", "round": 1, "rollouts": 72, "prompts": 9, "pass_rate": 0.4167},
              {"stage": "refine", "round": 1, "skipped": "already landed"},
              {"stage": "train", "round": 1, "policy_version": 2, "steps": 6, "first_loss": None}]

    @flow
    def publish(root: str, run_id: str, round: int, stages: list[dict]) -> None:
        publish_round_artifacts(Store(root), run_id, round, stages)

    publish(synthetic.root, SYN, 1, stages)
    publish_round_artifacts(synthetic, SYN, 2, stages)  # outside any run: nothing

    def read(key: str) -> list:
        with get_client(sync_client=True) as client:
            return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))

    assert slug(SYN).startswith("syn-run-1-") and slug(SYN) != slug("syn-run-1")  # no key shared with a look-alike
    (table,) = read(f"{slug(SYN)}-round-1")
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert rows == json.loads(json.dumps(round_table(synthetic, SYN, 1)))
    buckets = {r["item"]: r["value"] for r in rows if r["section"] == "buckets"}
    counts = q(synthetic, f"SELECT bucket, count(*) AS n FROM prompt_scores WHERE run_id = '{SYN}' AND round = 1 "
                          "GROUP BY 1")
    assert all(buckets[c["bucket"]] == c["n"] for c in counts) and sum(buckets.values()) == 17
    (summary,) = read(f"{slug(SYN)}-summary")
    md = summary.data
    assert md.startswith(f"# Run `{SYN}`, round 1")
    assert "**collect**: rollouts 72; prompts 9; pass_rate 0.4167" in md
    assert "**refine**: skipped (already landed)" in md and "**train**: policy_version 2; steps 6" in md
    assert f"too_hard {counts_of(counts, 'too_hard')}" in md
    assert read(f"{slug(SYN)}-round-2") == []


def counts_of(counts: list[dict], bucket: str) -> int:
    return sum(c["n"] for c in counts if c["bucket"] == bucket)


def test_a_remote_store_reports_into_a_local_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # a remote store's locks live there
    store = Store(f"memory://report-test-{tmp_path.name}")
    now = datetime(2026, 1, 1, tzinfo=UTC)
    store.commit("running-0", {"runs": pa.table({"run_id": ["m"], "created_at": [now], "status": ["running"],
                                                 "config": ["{}"]})}, run_id="m")
    ids = [f"p{i}" for i in range(12)]
    store.commit("score", {"prompt_scores": pa.table({
        "run_id": ["m"] * 12, "round": [0] * 12, "policy_version": [0] * 12, "prompt_id": ids, "n": [4] * 12,
        "mean_reward": [i / 11 for i in range(12)], "std_reward": [0.3] * 12, "eps": [0.05 * i for i in range(12)],
        "bucket": ["informative"] * 8 + ["too_hard"] * 4})}, run_id="m", round=0)
    folder = write_report(store, "m")
    assert folder == tmp_path / "refinery-reports" / "m"
    check_folder(folder, {"pass_rate", "eps", "buckets"})  # no refinements, evals or training: noted, not drawn
    with pytest.raises(ValueError, match=f"run 'n' is not in the store memory://report-test-{tmp_path.name}"):
        write_report(store, "n")


def test_the_calibration_table_is_the_predictions_beside_the_own_samples():
    """Two predictors, hand-counted: screening predicted 0.25 and 0.85 for prompts whose own samples passed 1 of 4
    and 3 of 4 (a few-shot-assisted success is not the prompt's own, a LoPE replacement counts as a failure);
    thompson predicted 0.5 for a prompt that passed 0 of 2, and a prompt nobody sampled is left out."""
    preds = pl.DataFrame({"selector": ["screening", "screening", "thompson", "thompson"], "round": [1, 1, 1, 1],
                          "prompt_id": ["a", "b", "a", "z"], "predicted_pass_rate": [0.25, 0.85, 0.5, 0.9]})
    lope = json.dumps({"lorem_perturb": {"replaced": True, "own_reward": 0.0}})
    fewshot = json.dumps({"fewshot_context": {"k": 1}})
    samples = pl.DataFrame({
        "round": [1] * 9, "prompt_id": ["a"] * 4 + ["b"] * 5,
        "reward": [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0], "correct": [True, False, False, True, True, True,
                                                                              True, False, True],
        "augmentation": [None, None, None, lope, None, None, None, None, fewshot]})
    cal = report_plots.calibration_frame(preds, samples)
    assert cal.select("selector", "prompt_id", "successes", "failures").rows() == [
        ("screening", "a", 1, 3), ("screening", "b", 3, 1), ("thompson", "a", 1, 3)]
    summary = {r["selector"]: r for r in report_plots.calibration_summary(cal).to_dicts()}
    s = summary["screening"]
    assert (s["prompts"], s["samples"]) == (2, 8) and s["observed"] == 0.5 and abs(s["predicted"] - 0.55) < 1e-12
    # deciles 2 and 8: |0.25 - 0.25| and |0.85 - 0.75|, weighted 4 and 4
    assert abs(s["calibration_error"] - 0.05) < 1e-12
    assert abs(summary["thompson"]["calibration_error"] - 0.25) < 1e-12


def test_a_screening_run_is_calibrated_on_its_screens_only():
    """With k_s = 2, prompt a's screen (samples 0-1) passed 1 of 2 and its top-ups 2 of 2; b's screen failed twice
    and got no top-up: only the screens count (3 of 4 would weight a by its mixed screen)."""
    preds = pl.DataFrame({"selector": ["screening"] * 2, "round": [2, 2], "prompt_id": ["a", "b"],
                          "predicted_pass_rate": [0.5, 0.2]})
    samples = pl.DataFrame({"round": [2] * 6, "prompt_id": ["a"] * 4 + ["b"] * 2, "sample_idx": [0, 1, 2, 3, 0, 1],
                            "reward": [1.0, 0.0, 1.0, 1.0, 0.0, 0.0], "correct": [True, False, True, True, False, False],
                            "augmentation": pl.Series([None] * 6, dtype=pl.String)})
    screened = report_plots.calibration_frame(preds, samples, screen_samples=2)
    assert screened.select("prompt_id", "successes", "failures").rows() == [("a", 1, 1), ("b", 0, 2)]
    every = report_plots.calibration_frame(preds, samples)  # a run without screening: its groups are whole
    assert every.select("prompt_id", "successes", "failures").rows() == [("a", 3, 1), ("b", 0, 2)]
