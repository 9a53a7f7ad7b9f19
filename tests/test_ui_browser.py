"""The UI path in a real browser: tests/ui_browser.py starts `refinery serve`, fills the curriculum deployment's
run form in Chromium (tiny model, 1 round), follows the run to completion, opens its HTML report and stops serve.

This test runs that script as a user would, then checks its summary against the store: the run the form
started landed with the values typed into the form, its report rendered, serve left no process behind, and every
form field showed a description. Marked `browser`; skipped when /usr/bin/chromium (Debian's `chromium`) or the
`playwright` package is missing. Set REFINERY_UI_SHOTS=DIR to keep the screenshots.
"""

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"


def test_no_description_hides_text_in_angle_brackets():
    """Without a browser: the UI renders descriptions as markdown, where <reasoning-gym task> is an HTML tag and
    vanishes ('rg:, or a .jsonl/.parquet path'); inside a code span (`rg:<task>`) it shows as written."""
    from flows.config import RunConfig

    def descriptions(node, path=""):
        if isinstance(node, dict):
            if isinstance(node.get("description"), str):
                yield path, node["description"]
            for key, value in node.items():
                yield from descriptions(value, f"{path}.{key}" if path else key)

    tag = re.compile(r"<[A-Za-z/][^<>]*>")
    hidden = {path: text for path, text in descriptions(RunConfig.model_json_schema())
              if tag.search(re.sub(r"`[^`]*`", "", text))}
    assert hidden == {}


@pytest.fixture(scope="module")
def browser_run(tmp_path_factory):
    """One drive of the UI for the module's checks: (exit code, stderr, summary, store)."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    pytest.importorskip("playwright", reason="the playwright package is missing (pip install -e '.[dev]')")
    tmp = tmp_path_factory.mktemp("ui")
    shots = Path(os.environ.get("REFINERY_UI_SHOTS") or tmp / "shots")
    store = tmp / "store"
    (shots / "summary.json").unlink(missing_ok=True)  # REFINERY_UI_SHOTS may hold an earlier run's
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "ui_browser.py"), "--screenshots", str(shots),
                             "--store", str(store), "--run-id", "ui-browser"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:  # SIGTERM lets the script stop serve; serve --stop covers the rest
        proc.terminate()
        _, stderr = proc.communicate(timeout=120)
        from flows.server.serve import ServeError, stop_running

        with contextlib.suppress(ServeError):
            stop_running(store.resolve() / ".prefect", timeout=60)
        pytest.fail(f"ui_browser.py did not finish in 900 s:\n{stderr[-3000:]}")
    summary_file = shots / "summary.json"
    assert summary_file.exists(), f"ui_browser.py wrote no summary (exit {proc.returncode}):\n{stderr[-3000:]}"
    return proc.returncode, stderr, json.loads(summary_file.read_text()), store


@pytest.mark.browser
def test_the_form_starts_a_tiny_run_that_completes_and_its_report_renders(browser_run):
    from flows.config import RunConfig
    from storage.query import sql
    from storage.runs import stored_config
    from storage.store import Store

    rc, stderr, summary, store = browser_run
    assert summary.get("flow_run", {}).get("state") == "COMPLETED", f"{summary.get('error')}\n{stderr[-3000:]}"
    # what the form sent is what was typed: the flow run's parameters, then the config the run stored
    assert summary["submitted"] == {"run_id": "ui-browser", "rounds": 1, "policy": "tiny-random", "sources": [5, 3]}
    served = Store(str(store))
    runs = sql(served, "SELECT status FROM runs WHERE run_id = 'ui-browser' ORDER BY created_at")
    assert runs.column("status").to_pylist() == ["running", "completed"]
    config = RunConfig.model_validate(stored_config(served, "ui-browser"))
    assert (config.rounds, config.model.policy, config.model.dtype, config.select.embedder) == \
        (1, "tiny-random", "fp32", "hashing")
    assert [(s.source, s.size) for s in config.pool.sources] == [("rg:products", 5), ("rg:basic_arithmetic", 3)]
    assert (config.rollout.group_size, config.rollout.max_new_tokens, config.shape.steps) == (4, 4, 2)
    rollouts = sql(served, "SELECT count(*) AS n, count(DISTINCT prompt_id) AS prompts, max(n_tokens) AS longest "
                           "FROM rollouts WHERE run_id = 'ui-browser'").to_pylist()[0]
    assert (rollouts["n"], rollouts["prompts"]) == (6 * 4, 6)  # 8 prompts less 2 held out, x group_size 4
    assert 1 <= rollouts["longest"] <= 4  # rollout.max_new_tokens as typed

    report = summary["report"]
    assert report["heading"] == "Run ui-browser"
    assert {"pass_rate.png", "eps.png", "buckets.png", "eval.png"} <= set(report["plots"])  # each one decoded
    assert Path(report["path"]) == store.resolve() / "_reports" / "run_id=ui-browser" / "index.html"
    # the round's table and the run's summary, published by the run the worker started, on its Artifacts tab
    assert {"table:ui-browser-round-0", "markdown:ui-browser-summary"} <= set(summary["artifacts"])
    assert summary["screenshots"] == ["01-deployments.png", "02-curriculum-deployment.png", "03-run-form.png",
                                      "04-run-form-refused.png", "05-run-form-filled.png", "06-submitted.png",
                                      "07-flow-run.png", "08-flow-run-final.png", "09-flow-run-artifacts.png",
                                      "10-report.png"]


@pytest.mark.browser
def test_the_form_refuses_a_value_out_of_its_bounds(browser_run):
    """RunConfig's bounds reach the form: rounds = 0 is refused with the field and the reason, and no run starts
    (the script counts the deployment's flow runs before and after)."""
    _, _, summary, _ = browser_run
    assert summary["refused"] == ("Error creating flow run: Validation failed for field 'config.rounds'. "
                                  "Failure reason: 0 is less than the minimum of 1")


@pytest.mark.browser
def test_serve_stops_clean_after_the_browser_run(browser_run):
    _, _, summary, _ = browser_run
    stop = summary["serve_stop"]
    assert (stop["stop_exit"], stop["serve_exit"], stop["processes_left"]) == (0, 0, []), stop


@pytest.mark.browser
def test_every_run_form_field_shows_its_description(browser_run):
    """Prefect draws the form from RunConfig's schema: a field without a description is a blank label, and text in
    <angle brackets> is dropped by the UI's markdown renderer."""
    rc, stderr, summary, _ = browser_run
    form = summary["form"]
    assert form["fields"] > 80  # every field of RunConfig was read, nested sections included
    assert form["without_description"] == [], "run-form fields with no description"
    assert form["mangled_description"] == [], "descriptions the UI shows differently from the schema"
    assert rc == 0 and summary["error"] is None, stderr
