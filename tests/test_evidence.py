"""The evidence page (issue 15): each checkpoint's cost on the three axes, held-out pass@1 at a matched budget,
the budget accounting and the external set, checked against the store by independent computations, and
benchmarks/evidence.py writing the page and its plots from a store of finished runs."""

import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from conftest import run_cli
from test_eval_dataset import SETS as SCRIPTED

from storage.query import scan, sql
from tasks.compare.figures import frame, query, run_curves
from tasks.compare.page import build, markdown
from tasks.compare.plots import plots
from tasks.core.curves import at_budget, matched_budget

# the scripted backend (real groups with mixed rewards, so GRPO takes steps) with training on; a batch of 2
# prompts, so dapo_filter (which draws every training prompt) discards groups whatever the seeds sample
SETS = [s for s in SCRIPTED if s != "train.enabled=false"] + ["eval.heldout_fraction=0.3", "select.batch_size=2",
                                                                  "eval.milestone_tokens=0"]
EXTERNAL = [{"id": "near/0", "question": "What is 2 + 3 + 4?", "answer": "9", "meta": {"kind": "near"}},
            {"id": "near/1", "question": "What is 3 * 3 * 2?", "answer": "18", "meta": {"kind": "near"}},
            {"id": "far/0", "question": "What is the GCD of 12 and 18?", "answer": "6", "meta": {"kind": "far"}}]


def test_interpolation_between_checkpoints_and_nothing_past_them():
    costs, p = [0, 10, 10, 30], [[0.0, 1.0], [0.2, 1.0], [0.4, 0.5], [1.0, 0.0]]
    assert at_budget(costs, p, 0).tolist() == [0.0, 1.0]
    assert at_budget(costs, p, 10).tolist() == [0.4, 0.5]  # equal costs: the newest checkpoint
    assert np.allclose(at_budget(costs, p, 20), [0.7, 0.25])
    assert at_budget(costs, p, 30.5) is None and at_budget(costs, p, -1) is None
    with pytest.raises(ValueError, match="must not decrease"):
        at_budget([0, 5, 4], p[:3], 1)
    with pytest.raises(ValueError, match="expected costs"):
        at_budget([0, 5], p, 1)
    assert matched_budget([40, 31, 55]) == 31


@pytest.fixture(scope="module")
def compared(prefect_api, tmp_path_factory):
    """uniform and refinery at 2 seeds (through the CLI, with an external set), dapo_filter at 1 (a second
    comparison in the same store), one round each, scripted, with training: every run has 2 evaluated
    checkpoints, the base model at cost 0 and its round-0 policy."""
    from flows.compare import compare, plan
    from storage.store import Store

    tmp = tmp_path_factory.mktemp("evidence")
    data = tmp / "ext.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in EXTERNAL))
    store = Store(tmp / "store")
    code, out, err = run_cli("compare", "--arms", "uniform,refinery", "--seeds", "2", "--prefix", "ev", "--rounds",
                             "1", "--store", store.root, "--dataset", str(data), *[x for s in SETS for x in ("--set", s)])
    assert code == 0, err
    head = next(i for i, ln in enumerate(out.splitlines()) if "at the matched budget of" in ln)
    assert [ln.split()[1] for ln in out.splitlines()[head + 1:head + 3]] == ["uniform:", "refinery:"]
    assert "; vs uniform " in out.splitlines()[head + 2]
    compare(["dapo_filter"], 1, "ev", SETS, {}, 1, store.root, datasets=[str(data)])
    planned = plan(["uniform", "refinery"], 2, "ev", SETS, {}) + plan(["dapo_filter"], 1, "ev", SETS, {})
    return store, planned, tmp


@pytest.mark.slow
def test_each_checkpoint_costs_what_the_rounds_before_it_generated(compared):
    store, planned, _ = compared
    points = frame(store, "CHECKPOINTS", "ev")
    tokens = scan(store, "generated_tokens").filter(pl.col("purpose") != "eval").collect()
    steps = scan(store, "train_steps").collect()
    assert points["run_id"].n_unique() == len(planned)
    for r in planned:
        mine = points.filter(pl.col("run_id") == r.run_id).sort("policy_version")
        assert mine["policy_version"].to_list() == [0, 1]
        for v, t, s, sec in mine.select("policy_version", "tokens", "steps", "seconds").iter_rows():
            before = (pl.col("run_id") == r.run_id) & (pl.col("round") < v)
            assert t == tokens.filter(before)["tokens"].sum() and s == steps.filter(before).height
            assert (sec == 0) if v == 0 else sec > 0
        assert mine["tokens"][1] > 0 and mine["steps"][1] > 0
    assert frame(store, "CHECKPOINTS", "other").height == 0  # the prefix confines the query
    with pytest.raises(ValueError, match="prefix"):
        query("CHECKPOINTS", "ev' OR 1=1 --")


@pytest.mark.slow
def test_pass1_at_the_matched_budget_is_the_per_prompt_interpolation(compared):
    store, planned, _ = compared
    curves = run_curves(store, "ev", [r.run_id for r in planned])
    ev = build(store, "ev", planned, ["ext"])
    budget = min(c.costs["tokens"][-1] for c in curves.values())
    assert ev.budgets["tokens"] == budget == matched_budget(c.last("tokens") for c in curves.values())
    results = scan(store, "eval_results").filter(pl.col("split") == "heldout").collect()
    for f in ev.arms:
        rows = []
        for run_id in f.run_ids:
            c = curves[run_id]
            got = results.filter(pl.col("run_id") == run_id).sort("policy_version", "prompt_id")
            per_version = got.with_columns((pl.col("n_correct") / pl.col("n_samples")).alias("p"))
            m = np.array([per_version.filter(pl.col("policy_version") == v)["p"].to_list() for v in c.versions])
            assert np.allclose(m, c.pass1)
            rows.append([np.interp(budget, c.costs["tokens"], m[:, j]) for j in range(m.shape[1])])
        assert f.at["tokens"].mean == pytest.approx(float(np.mean(rows)))
        assert f.at["tokens"].low <= f.at["tokens"].mean <= f.at["tokens"].high
    uniform, refinery = (next(f for f in ev.arms if f.arm == a) for a in ("uniform", "refinery"))
    assert uniform.diff["tokens"] is None and refinery.diff["tokens"].seeds == 2
    assert refinery.diff["tokens"].mean == pytest.approx(refinery.at["tokens"].mean - uniform.at["tokens"].mean)
    dapo = next(f for f in ev.arms if f.arm == "dapo_filter")
    assert dapo.diff["tokens"].seeds == 1  # paired with uniform's seed 0 only


@pytest.mark.slow
def test_budget_accounting_matches_the_rollouts(compared):
    store, planned, _ = compared
    ev = build(store, "ev", planned, ["ext"])
    rollouts = scan(store, "rollouts").collect()
    discarded = scan(store, "discarded_rollouts").collect()
    for f in ev.arms:
        mine = rollouts.filter(pl.col("run_id").is_in(f.run_ids))
        spread = mine.group_by("run_id", "round", "prompt_id").agg(pl.col("reward").n_unique() > 1)
        dropped = discarded.filter(pl.col("run_id").is_in(f.run_ids))
        groups = spread.height + dropped.select("run_id", "round", "gen_batch", "prompt_id").unique().height
        assert f.informative == pytest.approx(spread["reward"].sum() / groups)
        gone = dropped.height
        assert f.discarded_share == pytest.approx(gone / (gone + mine.height))
        ledger = scan(store, "generated_tokens").filter(pl.col("run_id").is_in(f.run_ids)).collect()
        assert f.purposes["rollout"] == pytest.approx(ledger.filter(pl.col("purpose") == "rollout")["tokens"].sum()
                                                      / len(f.run_ids))
    assert next(f for f in ev.arms if f.arm == "uniform").discarded_share == 0
    dapo = next(f for f in ev.arms if f.arm == "dapo_filter")
    assert dapo.discarded_share > 0 and dapo.informative < 1  # its discarded groups count as generated
    assert "lope" not in next(f for f in ev.arms if f.arm == "uniform").purposes


@pytest.mark.slow
def test_the_external_set_scores_each_last_checkpoint_and_the_base_model_once(compared):
    store, planned, _ = compared
    got = sql(store, "SELECT run_id, policy_version, count(*) AS n FROM eval_results WHERE split = 'dataset:ext' "
                     "GROUP BY ALL ORDER BY ALL").to_pylist()
    firsts = {"ev-uniform-s0", "ev-dapo_filter-s0"}  # the first run of each comparison also scores the base model
    want = [{"run_id": r.run_id, "policy_version": v, "n": 3} for r in planned
            for v in ([0] if r.run_id in firsts else []) + [1]]
    assert sorted(got, key=str) == sorted(want, key=str)
    ev = build(store, "ev", planned, ["ext"])
    refinery = next(f for f in ev.arms if f.arm == "refinery")
    assert set(refinery.external["ext"]) == {"all", "far", "near"}
    (all_, diff), (near, _) = refinery.external["ext"]["all"], refinery.external["ext"]["near"]
    assert (all_.seeds, all_.prompts, near.prompts) == (2, 3, 2) and diff.seeds == 2


@pytest.mark.slow
def test_the_page_prints_its_queries_and_they_reproduce_its_numbers(compared, tmp_path):
    store, planned, _ = compared
    ev = build(store, "ev", planned, ["ext"])
    page = markdown(ev, ["ext"], "# header", "## design")
    for name in ("CHECKPOINTS", "PASS", "GROUPS", "DISCARDED", "TOKENS", "RUNTIME"):
        text = query(name, "ev")
        assert text in page
        assert sql(store, text).num_rows > 0  # each runs as printed
    assert "| `refinery` | 2 | 1.0 |" in page and "External set `ext`" in page and "| base model |" in page
    # the printed GROUPS query gives the page's informative-group ratio (pooled over the arm's runs)
    groups = sql(store, query("GROUPS", "ev")).to_pylist()
    for f in ev.arms:
        mine = [g for g in groups if g["run_id"] in f.run_ids]
        pooled = sum(g["informative_groups"] for g in mine) / sum(g["kept_groups"] + g["discarded_groups"] for g in mine)
        assert f.informative == pytest.approx(float(pooled)) and f"| {f.informative:.3f} |" in page
    assert "## Result against the goal" in page and "informative-group ratio >= 0.85" in page
    figs = plots(ev)
    assert sorted(figs) == ["pass1_vs_seconds", "pass1_vs_steps", "pass1_vs_tokens"]
    figs["pass1_vs_tokens"].savefig(tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_the_cost_section_counts_each_runs_starts_and_all_its_tokens(compared):
    store, planned, _ = compared
    ev = build(store, "ev", planned, ["ext"])
    marks = scan(store, "runs").collect().sort("created_at")
    ledger = scan(store, "generated_tokens").collect()
    for f in ev.arms:
        assert len(f.wall_s) == len(f.run_ids)
        for run_id, seconds in zip(f.run_ids, f.wall_s):
            mine = marks.filter(pl.col("run_id") == run_id)
            assert mine["status"].to_list() == ["running", "completed"]
            # epoch() is a double of seconds since 1970: about a microsecond of rounding in each difference
            assert seconds == pytest.approx((mine["created_at"][1] - mine["created_at"][0]).total_seconds(), abs=1e-3)
        assert sum(f.purposes.values()) * len(f.run_ids) == pytest.approx(
            ledger.filter(pl.col("run_id").is_in(f.run_ids))["tokens"].sum())
    page = markdown(ev, ["ext"], "# header", "## design")
    assert "## Cost of this comparison" in page and f"In all: {len(planned)} runs, " in page
    # a resumed run counts each start until its failure or completion, not the time it lay stopped
    from storage.runs import mark

    mark(store, "cost-x-s0", "running", {})
    mark(store, "cost-x-s0", "failed", {})
    mark(store, "cost-x-s0", "running", {})  # recorded as 'resumed'
    mark(store, "cost-x-s0", "completed", {})
    rows = scan(store, "runs").filter(pl.col("run_id") == "cost-x-s0").collect().sort("created_at")
    assert rows["status"].to_list() == ["running", "failed", "resumed", "completed"]
    t = rows["created_at"]
    want = (t[1] - t[0]).total_seconds() + (t[3] - t[2]).total_seconds()
    got = dict(frame(store, "RUNTIME", "cost").select("run_id", "seconds").iter_rows())["cost-x-s0"]
    assert got == pytest.approx(want, abs=1e-3)


def _evidence_script():
    """benchmarks/evidence.py as a module (benchmarks/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("evidence", Path(__file__).parent.parent / "benchmarks" / "evidence.py")
    evidence = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(evidence)
    return evidence


@pytest.mark.slow
def test_evidence_script_writes_the_page_of_the_finished_runs(compared, tmp_path, capsys):
    evidence = _evidence_script()
    store, _, _ = compared
    out = tmp_path / "docs" / "evidence.md"
    sets = [x for s in SETS for x in ("--set", s)]
    assert evidence.main(["--store", store.root, "--seeds", "2", "--out", str(out), *sets]) == 2
    assert "planned run(s) not finished (first: ev-eps_kmeans-s0)" in capsys.readouterr().err
    # runs made with other settings than the design's (here: without the scripted overrides) are refused
    assert evidence.main(["--store", store.root, "--seeds", "2", "--partial", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("evidence: ev-uniform-s0 was not run with this design: differs in: ") and "model.backend" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
    reading = tmp_path / "reading.md"
    reading.write_text("## Reading\n\nno_refine hurts least.\n")
    evidence.READING = reading  # the hand-written reading goes under the generated verdict
    assert evidence.main(["--store", store.root, "--seeds", "2", "--partial", "--out", str(out),
                          "--json", str(tmp_path / "e.json"), *sets]) == 0
    page = out.read_text()
    assert page.index("## Result against the goal") < page.index("## Reading\n\nno_refine hurts least.") < page.index(
        "## Tables")
    assert "Not finished when this page was written, so left out: `ev-eps_kmeans-s0`" in page
    assert "| `uniform` | 2 |" in page and "| `dapo_filter` | 1 |" in page
    assert sorted(p.name for p in (tmp_path / "docs" / "evidence").iterdir()) == [
        "pass1_vs_seconds.png", "pass1_vs_steps.png", "pass1_vs_tokens.png"]
    figures = json.loads((tmp_path / "e.json").read_text())
    heldout = sql(store, "SELECT count(*) AS n FROM pool WHERE run_id = 'ev-uniform-s0' AND round = 0 "
                         "AND status = 'heldout'").to_pylist()[0]["n"]
    assert figures["heldout_prompts"] == heldout > 0 and "refinery_vs_uniform_at_tokens" in figures
    # the commit the runs were made at (tests pin one: conftest.py), on the page and in the figures
    assert "The runs on this page were made at commit `tests`, with no uncommitted changes." in page
    assert "Warning" not in page and figures["commits"] == ["tests"] and figures["dirty_runs"] == []


def test_the_evidence_page_refuses_mixed_commits_unless_allowed_and_then_warns_first(compared, tmp_path, capsys,
                                                                                      monkeypatch):
    import shutil

    from storage.runs import mark, stored_config
    from storage.store import Store

    evidence = _evidence_script()
    shutil.copytree(compared[0].root, tmp_path / "store")
    store = Store(tmp_path / "store")
    monkeypatch.setenv("REFINERY_CODE_VERSION", "c0ffee")  # ev-uniform-s1 resumed by other code
    mark(store, "ev-uniform-s1", "running", stored_config(store, "ev-uniform-s1"))
    mark(store, "ev-uniform-s1", "completed", stored_config(store, "ev-uniform-s1"))
    args = ["--store", store.root, "--seeds", "2", "--partial", "--out", str(tmp_path / "e.md"),
            *[x for s in SETS for x in ("--set", s)]]
    assert evidence.main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("evidence: mixed code: its runs come from 2 commits (c0ffee, tests)") and err.count("\n") == 1
    assert not (tmp_path / "e.md").exists()
    assert evidence.main([*args, "--allow-mixed", "--json", str(tmp_path / "e.json")]) == 0
    page = (tmp_path / "e.md").read_text().splitlines()
    assert page[2].startswith("**Warning, mixed code: its runs come from 2 commits (c0ffee, tests)**")
    assert json.loads((tmp_path / "e.json").read_text())["commits"] == ["c0ffee", "tests"]


def test_a_missing_external_file_is_refused_before_any_run(prefect_api, store, tmp_path):
    code, _, err = run_cli("compare", "--arms", "uniform", "--seeds", "1", "--store", store.root,
                           "--dataset", str(tmp_path / "nope.jsonl"), *[x for s in SETS for x in ("--set", s)])
    assert code != 0 and "nope.jsonl" in err and len(err.strip().splitlines()) == 1
    for folder in ("a", "b"):  # two files of one name would collide in eval_results' split
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "ext.jsonl").write_text(json.dumps(EXTERNAL[0]) + "\n")
    code, _, err = run_cli("compare", "--arms", "uniform", "--seeds", "1", "--store", store.root,
                           "--dataset", str(tmp_path / "a" / "ext.jsonl"), "--dataset", str(tmp_path / "b" / "ext.jsonl"),
                           *[x for s in SETS for x in ("--set", s)])
    assert code != 0 and "share the name 'ext'" in err and len(err.strip().splitlines()) == 1
    assert not (Path(store.root) / "runs").exists()


@pytest.mark.slow
def test_a_checkpoint_evaluated_again_counts_once(compared, monkeypatch):
    """`refinery eval` reports landed numbers (tasks/evaluate.py); a store holding a version's held-out rows
    twice (one written before that, or landed by a race) still counts them once."""
    import tasks.evaluate

    store, planned, _ = compared
    before = build(store, "ev", planned, ["ext"])
    monkeypatch.setattr(tasks.evaluate, "landed_heldout", lambda *_: {})  # sample it again, as before 8f148bf
    code, _, err = run_cli("eval", "--run-id", "ev-uniform-s1", "--checkpoint", "1", "--store", store.root)
    assert code == 0, err
    again = sql(store, "SELECT count(*) AS n FROM eval_results WHERE run_id = 'ev-uniform-s1' AND split = 'heldout' "
                       "AND policy_version = 1").to_pylist()[0]["n"]
    assert again == 2 * before.heldout_prompts  # landed twice (stage eval-v1), counted once
    after = build(store, "ev", planned, ["ext"])
    assert [f.at for f in after.arms] == [f.at for f in before.arms]


@pytest.mark.slow
def test_a_store_copied_without_its_weights_reruns_as_complete(compared, tmp_path):
    """The comparison's store travels without `_checkpoints/` (benchmarks/evidence/store); rerunning the
    comparison on that copy skips the complete runs instead of failing on their missing weights, and the
    page rebuilds from it alone."""
    import shutil

    from flows.compare import compare

    store, planned, tmp = compared
    from storage.store import Store

    shutil.copytree(store.root, tmp_path / "copy", ignore=shutil.ignore_patterns("_checkpoints", ".locks", ".tmp"))
    copy = Store(tmp_path / "copy")
    assert not Path(copy.root, "_checkpoints").exists() and Path(store.root, "_checkpoints").is_dir()
    before = sql(copy, "SELECT count(*) AS n FROM rollouts").to_pylist()
    weights = Path(store.root, "_checkpoints")  # the copy's records name these folders: hide them, as on
    weights.rename(weights.with_name("hidden"))  # another machine
    try:
        out = compare(["uniform", "refinery"], 2, "ev", SETS, {}, 1, copy.root, datasets=[str(tmp / "ext.jsonl")])
    finally:
        weights.with_name("hidden").rename(weights)
    assert [r["result"].get("skipped") for r in out] == ["already complete"] * 4
    assert sql(copy, "SELECT count(*) AS n FROM rollouts").to_pylist() == before
    assert repr(build(copy, "ev", planned, ["ext"]).arms) == repr(build(store, "ev", planned, ["ext"]).arms)  # NaN != NaN


def test_the_page_lists_where_each_run_ran(tmp_path):
    from storage.runs import mark
    from storage.store import Store

    evidence = _evidence_script()
    for uri in (str(tmp_path / "store"), "memory://machines"):  # an object store cannot append: rewritten whole
        store = Store(uri)
        evidence.record_machine(uri, "a")
        evidence.record_machine(uri, "b")
        mark(store, "b", "completed", {"rounds": 1})
        evidence.record_machine(uri, "b")  # finished: compare skips it, and its record stays as it was
        lines = store.fs.cat_file(store.path("_machines.jsonl")).decode().splitlines()
        assert [json.loads(x)["run_id"] for x in lines] == ["a", "b"]
        assert evidence.machines(store, ["a", "b", "c"]) == [f"- {evidence.machine()}: `a`, `b`", "- not recorded: `c`"]


def test_confirm_runs_one_ablation_at_the_core_seeds():
    """`--confirm no_lope` plans `no_lope` at --seeds paired seeds after the other ablations at one, so the
    runs already made keep their ids and only seeds 1 and 2 are new; an unknown ablation is refused."""
    evidence = _evidence_script()
    from flows.compare import plan

    groups = evidence.arm_groups(3, 1, ["no_lope"])
    assert groups == [(evidence.CORE, 3), (["no_refine", "no_shape", "no_fewshot"], 1), (["no_lope"], 3)]
    ids = [r.run_id for arms, n in groups[1:] for r in plan(arms, n, "ev", [], {})]
    assert ids == ["ev-no_refine-s0", "ev-no_shape-s0", "ev-no_fewshot-s0", "ev-no_lope-s0", "ev-no_lope-s1",
                   "ev-no_lope-s2"]
    assert evidence.arm_groups(3, 1, [])[1:] == [(evidence.ABLATIONS, 1)]
    with pytest.raises(SystemExit):
        evidence.main(["--store", "unused", "--confirm", "uniform"])
