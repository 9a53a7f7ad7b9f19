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
    assert "; token exchange " in out.splitlines()[head + 2] and "token exchange" not in out.splitlines()[head + 1]
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
        # the first table's rounds and tokens/run: rounds that collected, generated tokens without evaluation
        collected = ledger.filter(pl.col("stage") == "collect").select("run_id", "round").unique().height
        assert f.rounds == collected / len(f.run_ids)
        assert f.tokens == pytest.approx(ledger.filter(pl.col("purpose") != "eval")["tokens"].sum() / len(f.run_ids))
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


@pytest.mark.slow  # it needs the `compared` runs (40 s), which only the slow tests build otherwise
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


def test_runs_in_bf16_and_fp32_are_named_as_mixed_arithmetic(tmp_path):
    """`mixed_arithmetic` reads each run's `model.dtype` ("auto": the machine it last started on) and names the
    runs of each arithmetic in one line; one arithmetic, or runs with no machine record, say nothing."""
    from storage.runs import mark
    from storage.store import Store

    evidence = _evidence_script()
    store = Store(tmp_path / "store")
    amd = "AMD EPYC, 2 cores visible, native bf16: avx512_bf16; Python 3.11.7, torch 2.13.0+cpu, 1 threads"
    xeon = "Intel(R) Xeon(R) Processor, 2 cores visible, native bf16: no; Python 3.11.7, torch 2.13.0+cpu, 1 threads"
    records = [("ev-a-s0", xeon), ("ev-a-s0", amd), ("ev-a-s1", amd), ("ev-b-s0", xeon)]  # the last start counts
    Path(store.root).mkdir(parents=True)
    Path(store.root, "_machines.jsonl").write_text("".join(json.dumps({"run_id": r, "machine": m}) + "\n"
                                                           for r, m in records))
    for run, dtype in (("ev-a-s0", "auto"), ("ev-a-s1", "auto"), ("ev-b-s0", "auto"), ("ev-b-s1", "bf16"),
                       ("ev-c-s0", "auto")):
        mark(store, run, "completed", {"model": {"dtype": dtype}})
    assert evidence.mixed_arithmetic(store, ["ev-a-s0", "ev-a-s1", "ev-b-s1", "ev-c-s0"]) is None
    line = evidence.mixed_arithmetic(store, ["ev-a-s0", "ev-a-s1", "ev-b-s0", "ev-b-s1"])
    assert line.startswith("mixed arithmetic: of the runs, 3 in bf16 (`ev-a-s0`, `ev-a-s1`, `ev-b-s1`); "
                           "1 in fp32 (`ev-b-s0`)") and "\n" not in line
    mark(store, "ev-b-s1", "completed", {"model": {"dtype": "fp32"}})  # its last row: an explicit fp32
    assert evidence.mixed_arithmetic(store, ["ev-a-s0", "ev-a-s1", "ev-b-s1"]).startswith(
        "mixed arithmetic: of the runs, 2 in bf16 (`ev-a-s0`, `ev-a-s1`); 1 in fp32 (`ev-b-s1`)")


def test_merging_runs_copies_finished_runs_whole_and_refuses_the_rest(tmp_path):
    """benchmarks/evidence_design.py `merge_runs` over two stores made by hand: a finished run's folders of every
    table, the shared ingest stage files the target lacks and its machine line are copied; a run not finished
    in the source, one already in the target with other files, or the store itself as its own source are refused
    in one line before anything is copied; a merge stopped part way completes when run again."""
    from storage.runs import mark
    from storage.store import Store

    evidence = _evidence_script()
    src, dst = Store(tmp_path / "src"), Store(tmp_path / "dst")
    for store, run in ((src, "ev-a-s1"), (src, "ev-a-s2"), (dst, "ev-a-s0")):
        evidence.record_machine(store.root, run)
        if run != "ev-a-s2":
            mark(store, run, "completed", {"rounds": 1})
        part = Path(store.root, "rollouts", f"run_id={run}", "round=0")
        part.mkdir(parents=True)
        (part / "rows.parquet").write_bytes(run.encode())
    for store, name in ((src, "abc.parquet"), (src, "shared.parquet"), (dst, "shared.parquet")):
        f = Path(store.root, "prompts", "run_id=_ingest", name)
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(f"{store.root}:{name}".encode())
    with pytest.raises(ValueError, match=r"^merging runs: ev-a-s2 not finished in .*src$"):
        evidence.merge_runs(src, dst, ["ev-a-s1", "ev-a-s2"])
    with pytest.raises(ValueError, match="source and target are the same store"):
        evidence.merge_runs(src, Store(tmp_path / "src"), ["ev-a-s1"])
    with pytest.raises(ValueError, match=r"ev-a-s1 not scored on the external sets in .*src yet"):
        evidence.merge_runs(src, dst, ["ev-a-s1"], ["ext"])  # finished, its external scoring still to come
    assert not Path(dst.root, "rollouts", "run_id=ev-a-s1").exists()  # nothing copied by a refused merge
    assert evidence.merge_runs(src, dst, ["ev-a-s1"]) == ["ev-a-s1"]
    assert Path(dst.root, "rollouts", "run_id=ev-a-s1", "round=0", "rows.parquet").read_bytes() == b"ev-a-s1"
    assert evidence.finished(dst, ["ev-a-s0", "ev-a-s1", "ev-a-s2"]) == {"ev-a-s0", "ev-a-s1"}
    ingest = Path(dst.root, "prompts", "run_id=_ingest")
    assert (ingest / "abc.parquet").read_bytes().endswith(b"src:abc.parquet")  # the stage it lacked
    assert (ingest / "shared.parquet").read_bytes().endswith(b"dst:shared.parquet")  # one name, one stage: kept
    machines = [json.loads(x)["run_id"] for x in Path(dst.root, "_machines.jsonl").read_text().splitlines()]
    assert machines == ["ev-a-s0", "ev-a-s1"] and not Path(dst.root, ".tmp", "merge").exists()
    # stopped part way (its data moved in, its runs rows and landing records not yet), run again: completed
    import shutil

    for table in ("runs", "_landed"):
        shutil.rmtree(Path(dst.root, table, "run_id=ev-a-s1"))
    assert evidence.finished(dst, ["ev-a-s1"]) == set()
    assert evidence.merge_runs(src, dst, ["ev-a-s1"]) == ["ev-a-s1"]
    assert evidence.finished(dst, ["ev-a-s1"]) == {"ev-a-s1"}
    assert len(Path(dst.root, "_machines.jsonl").read_text().splitlines()) == 2  # nothing doubled
    assert evidence.merge_runs(src, dst, ["ev-a-s1"]) == []  # whole there already: nothing to do
    Path(dst.root, "rollouts", "run_id=ev-a-s1", "round=0", "rows.parquet").write_bytes(b"ev-a-s2")  # same size
    with pytest.raises(ValueError, match=r"ev-a-s1 is in .*dst already \(rollouts\) with other files"):
        evidence.merge_runs(src, dst, ["ev-a-s1"])
    with pytest.raises(ValueError, match="needs local stores"):
        evidence.merge_runs(src, Store("memory://merge"), ["ev-a-s1"])


def test_only_is_refused_without_a_run_or_a_merge_and_names_an_unplanned_run(tmp_path, capsys):
    evidence = _evidence_script()
    assert evidence.main(["--store", str(tmp_path / "s"), "--only", "ev-uniform-s0"]) == 2
    assert capsys.readouterr().err == ("evidence: --only names the runs to --run or to take with --merge-from; "
                                       "give one of them\n")
    assert evidence.main(["--store", str(tmp_path / "s"), "--arms", "uniform", "--seeds", "1", "--run",
                          "--only", "ev-uniform-s0,ev-default-s0"]) == 1
    assert capsys.readouterr().err == ("evidence: --only ev-default-s0: not a planned run of this comparison "
                                       "(planned: ev-uniform-s0)\n")
    assert not Path(tmp_path / "s").exists()  # refused before anything ran


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


# ---- issue 49's figures: the seed-level test, strata, budgets and the area under the curve, pairs -------------
def test_a_stratum_no_checkpoint_solves_is_flagged_and_left_out_of_the_second_total():
    from tasks.compare.strata import by_stratum, solved_columns, totals_without

    strata = {"a": "easy", "b": "easy", "c": "never", "d": "hard"}
    ids = ["a", "b", "c", "d"]
    every = np.array([[0.5, 1.0, 0.0, 0.0], [0.0, 0.5, 0.0, 0.125]])  # no checkpoint solves c; d once
    at = {"uniform": np.array([[0.5, 1.0, 0.0, 0.0], [1.0, 0.5, 0.0, 0.0]]),
          "default": np.array([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])}
    figs = by_stratum(strata, ids, at, every)
    assert [(f.name, f.prompts, f.never_solved) for f in figs] == [("easy", 2, False), ("never", 1, True),
                                                                      ("hard", 1, False)]
    assert figs[0].pass1 == {"uniform": 0.75, "default": 1.0}
    keep = solved_columns(strata, ids, figs)
    assert keep.tolist() == [True, True, False, True]
    totals = totals_without(at, {"uniform": [0, 1], "default": [0, 1]}, "uniform", keep)
    assert totals["uniform"][0].mean == pytest.approx(3.0 / 6) and totals["uniform"][1] is None
    assert totals["default"][0].mean == pytest.approx(4.0 / 6)
    assert totals["default"][1].mean == pytest.approx(1.0 / 6) and totals["default"][1].seeds == 2


def test_the_area_under_the_curve_is_the_trapezoid_up_to_the_budget_over_the_budget():
    from tasks.core.curves import area_under

    costs, p = [0, 400, 800, 1200], [[0.0, 1.0], [0.5, 1.0], [1.0, 0.0], [1.0, 0.0]]
    got = area_under(costs, p, 1000)
    first = (0.5 * 400 * 0.5 + 400 * 0.75 + 200 * 1.0) / 1000  # (0,0)-(400,.5)-(800,1)-(1000,1)
    second = (400 * 1.0 + 400 * 0.5 + 200 * 0.0) / 1000
    assert got.tolist() == pytest.approx([first, second])
    assert area_under(costs, p, 1200.5) is None and area_under(costs, p, 1200) is not None


def test_the_token_exchange_reads_each_curve_at_its_first_crossing():
    """The lower of the two figures at the budget, and each run's first tokens to it (the mean over prompts,
    linear between checkpoints, the first crossing of a curve that dips): base over arm. A run against itself is
    1.0, dips or not; a hair above or below the base reads alike; no exchange where a run did not reach the
    budget, where nothing was generated, or where neither run rose above the shared base model."""
    from tasks.core.curves import token_exchange

    costs = [0, 20000, 40000, 60000]

    def two(*means):  # two prompts whose mean is each value
        return [[m - 0.1, m + 0.1] for m in means]

    base = two(0.2, 0.4, 0.45, 0.5)
    assert token_exchange(costs, two(0.2, 0.3, 0.45, 0.55), costs, base, 60000) == pytest.approx(60 / 50)
    assert token_exchange(costs, two(0.2, 0.3, 0.35, 0.4), costs, base, 60000) == pytest.approx(20 / 60)
    dips = two(0.2, 0.5, 0.4, 0.45)  # reaches 0.45 first at 16,667 tokens, on the way up to 0.5
    assert token_exchange(costs, two(0.2, 0.3, 0.4, 0.45), costs, dips, 60000) == pytest.approx(50 / 180)
    assert token_exchange(costs, base, costs, base, 60000) == pytest.approx(1.0)
    assert token_exchange(costs, dips, costs, dips, 60000) == pytest.approx(1.0)
    above, below = (token_exchange(costs, two(0.2, 0.3, 0.4, 0.45 + e), costs, dips, 60000) for e in (1e-4, -1e-4))
    assert above == pytest.approx(below, abs=1e-3)
    flat = two(0.2, 0.2, 0.2, 0.2)
    assert token_exchange(costs, base, costs, flat, 60000) is None
    assert token_exchange(costs, flat, costs, flat, 60000) is None
    assert token_exchange(costs[:3], base[:3], costs, base, 60000) is None
    assert token_exchange([0], [[0.2]], [0], [[0.3]], 0) is None  # nothing generated (training off): none


def test_the_external_set_is_read_at_the_matched_checkpoint_only_when_every_run_has_one():
    from tasks.compare.external import choose, matched_versions
    from tasks.compare.figures import RunCurve

    def curve(run_id, tokens):
        return RunCurve(run_id, list(range(len(tokens))), {"tokens": tokens}, np.zeros((len(tokens), 1)), ["p"])

    curves = {"a": curve("a", [0, 400, 800, 1200]), "b": curve("b", [0, 800, 1600])}
    matched = matched_versions(curves, 800)
    assert matched == {"a": 2, "b": 1}  # a's checkpoint at 800 is not its last
    rows = pl.DataFrame({"run_id": ["a", "a", "b", "b"], "policy_version": [2, 3, 1, 2]})
    assert choose(rows, ["a", "b"], matched) == ({"a": 2, "b": 1}, "matched")
    assert choose(rows.filter(pl.col("policy_version") != 1), ["a", "b"], matched) == ({"a": 3, "b": 2}, "last")
    assert matched_versions(curves, 1000) == {"a": None, "b": None}  # between checkpoints: no matched checkpoint


def test_work_seconds_count_generation_and_training_but_not_evaluation_or_a_stopped_gap():
    from tasks.compare.timing import stage_seconds, work_seconds

    def rec(rnd, stage, t):
        return {"run_id": "r", "round": rnd, "stage": stage, "committed_at": f"2026-01-01T00:{t // 60:02d}:{t % 60:02d}+00:00"}

    class Records:
        def records(self):
            return [rec(None, "running-0", 0), rec(0, "pool", 1), rec(0, "select", 2), rec(0, "collect", 12),
                    rec(0, "score", 13), rec(0, "teacher-ab12", 15), rec(0, "refine", 18), rec(0, "train", 30),
                    rec(0, "evaluate", 50), rec(None, "failed-1", 55),
                    rec(None, "resumed-2", 600), rec(1, "pool", 601), rec(1, "select", 602),  # stopped 545 s
                    {**rec(1, "screen", 605), "tables": {"generated_tokens": {}}},  # a generating stage of a new name
                    rec(1, "collect", 610), rec(1, "score", 611), rec(1, "train", 620), rec(1, "evaluate", 640),
                    {**rec(1, "eval-v2-ext-ab12", 700), "tables": {"generated_tokens": {}}},  # external: not work
                    {**rec(0, "collect", 5), "run_id": "other"}]

    stages = stage_seconds(Records(), ["r"])["r"]
    assert stages[0] == {"pool": 1, "select": 1, "collect": 10, "score": 1, "refine": 5, "train": 12, "evaluate": 20}
    assert stages[1]["pool"] == 1  # counted from the resume, not from the failure
    assert (stages[1]["other generation"], stages[1]["collect"]) == (3, 5)
    assert [work_seconds(stages, v) for v in (0, 1, 2)] == [0, 27, 27 + 3 + 5 + 9]


WORDS = [{"id": f"w{i}", "question": q, "answer": a} for i, (q, a) in enumerate(
    [("Name a colour.", "blue"), ("Name a fruit.", "apple"), ("Name an animal.", "cat"), ("Name a month.", "may")])]
# milestones every 1000 generated tokens and a budget of 1000: the scripted rounds here make 600-950 tokens, so
# every run stops after round 1, at its milestone 1000 (the matched budget, a checkpoint of every run)
MS_EVERY = MS_BUDGET = 1000
HALF = MS_BUDGET // 2  # a design budget between two checkpoints: interpolated


def _ms_sets(words: Path) -> list[str]:
    """Milestone evaluation, a stratified held-out split, a budget, and a pool with a stratum the scripted
    policy can never solve (no arithmetic in it)."""
    from test_milestones import SETS as MILESTONES

    pool = ('pool.sources=[{"source": "rg:products", "size": 10, "params": {"max_digits": 1}}, '
            '{"source": "rg:chain_sum", "size": 10, "params": {"min_terms": 2, "max_terms": 2, "max_digits": 1}}, '
            f'{{"source": "{words}", "size": 4}}]')
    return [*[s for s in MILESTONES if not s.startswith("pool.sources")], pool, f"eval.milestone_tokens={MS_EVERY}",
            "eval.heldout_split=stratified", "eval.heldout_fraction=0.3", f"max_generated_tokens={MS_BUDGET}"]


@pytest.fixture(scope="module")
def milestoned(prefect_api, tmp_path_factory):
    """`uniform` and `default` at 2 paired seeds, evaluated at milestones, with an external set, under an empty
    shared config file (so benchmarks/evidence.py can check the runs against it)."""
    from flows.compare import compare, plan
    from storage.store import Store

    tmp = tmp_path_factory.mktemp("milestoned")
    words = tmp / "words.jsonl"
    words.write_text("".join(json.dumps(r) + "\n" for r in WORDS))
    data = tmp / "ext.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in EXTERNAL))
    design = tmp / "design.toml"
    design.write_text("# the tests' design: everything is in --set\n")
    store, sets = Store(tmp / "store"), _ms_sets(words)
    compare(["uniform", "default"], 2, "ev", sets, {}, 4, store.root, str(design), datasets=[str(data)])
    return store, plan(["uniform", "default"], 2, "ev", sets, {}), sets, design, data


def _at_milestone(store, run_id: str, budget: float) -> tuple[int, np.ndarray]:
    """(the version evaluated at milestone `budget`, its per-prompt held-out pass@1 in prompt-id order)."""
    v = sql(store, f"SELECT policy_version AS v FROM evals WHERE run_id = '{run_id}' AND split = 'heldout' AND "
                   f"milestone = {int(budget)}").to_pylist()[0]["v"]
    rows = sql(store, f"SELECT prompt_id, n_correct / n_samples AS p FROM eval_results WHERE run_id = '{run_id}' "
                      f"AND split = 'heldout' AND policy_version = {v} ORDER BY prompt_id").to_pylist()
    return v, np.array([r["p"] for r in rows])


@pytest.mark.slow
def test_the_seed_test_strata_budgets_and_pairs_match_a_direct_computation(milestoned):
    import itertools

    from tasks.core.seed_test import seeds_needed

    store, planned, _, _, _ = milestoned
    ev = build(store, "ev", planned, ["ext"], design_budgets=[HALF, 10**6])
    budget = ev.budgets["tokens"]
    assert budget == MS_BUDGET  # read at the milestone every run reached
    for f in ev.arms:  # milestone curves hold the evaluated checkpoints only: rounds and tokens are not read off them
        ids = f.run_ids
        collected = (scan(store, "generated_tokens").filter(pl.col("run_id").is_in(ids) & (pl.col("stage") == "collect"))
                     .select("run_id", "round").unique())
        assert f.rounds == collected.collect().height / len(ids)
        spent = scan(store, "generated_tokens").filter(pl.col("run_id").is_in(ids) & (pl.col("purpose") != "eval"))
        assert f.tokens == pytest.approx(spent.collect()["tokens"].sum() / len(ids))
        # near the budget, not past it by up to a round: how near is tests/test_budget_fit.py's (here a screened
        # round of 3 picks cost 489 tokens against 672 for 6: at this size a round's noise is a pick or two)
        assert abs(f.tokens - budget) < 0.2 * budget
    runs = {(r.arm, r.seed): r.run_id for r in planned}
    x = {k: _at_milestone(store, run, budget)[1] for k, run in runs.items()}
    d = np.array([x["default", s].mean() - x["uniform", s].mean() for s in (0, 1)])
    dec = ev.decisions["default"]
    assert dec.paired_seeds == 2 and dec.test.d == pytest.approx(d.tolist())
    flips = [abs(np.mean(np.array(signs) * d)) >= abs(d.mean()) - 1e-12 for signs in itertools.product((1, -1), repeat=2)]
    assert dec.test.p == pytest.approx(np.mean(flips))
    base = np.mean([x["uniform", s].mean() for s in (0, 1)])
    assert dec.test.power_seeds == seeds_needed(float(np.std(d, ddof=1)), 0.1 * base)
    assert ev.decisions["uniform"].test is None
    # pass@1 at the design's budgets: halfway between the base model and the milestone; one past every run's
    # reach is not reached
    half = np.mean([(_at_milestone(store, runs["default", s], 0)[1] + x["default", s]).mean() / 2 for s in (0, 1)])
    assert dec.at_design[HALF].mean == pytest.approx(half) and dec.at_design[10**6] is None
    # the area under the curve: the trapezoid over each run's milestone checkpoints, over the budget
    areas = []
    for s in (0, 1):
        marks = sql(store, f"SELECT milestone AS m, policy_version AS v FROM evals WHERE run_id = "
                           f"'{runs['default', s]}' AND split = 'heldout' AND milestone <= {int(budget)} "
                           "ORDER BY milestone").to_pylist()
        ms = [r["m"] for r in marks]
        ys = [_at_milestone(store, runs["default", s], m)[1].mean() for m in ms]
        areas.append(np.trapezoid(ys, ms) / budget)
    assert dec.auc.mean == pytest.approx(np.mean(areas))
    # strata: the word prompts are flagged, hold no solved answer, and leave the second total
    words = [s for s in ev.strata if s.name.endswith("words.jsonl")]
    assert len(words) == 1 and words[0].never_solved and set(words[0].pass1.values()) == {0.0}
    assert not any(s.never_solved for s in ev.strata if s is not words[0])
    assert sum(s.prompts for s in ev.strata) == ev.heldout_prompts
    strata = {r["stratum"]: r["n"] for r in sql(store, "SELECT stratum, count(*) AS n FROM pool WHERE run_id = "
                                                      "'ev-uniform-s0' AND round = 0 AND status = 'heldout' "
                                                      "GROUP BY ALL").to_pylist()}
    assert {s.name: s.prompts for s in ev.strata} == strata
    never = [r["prompt_id"] for r in sql(store, "SELECT prompt_id FROM pool WHERE run_id = 'ev-uniform-s0' AND round = 0 "
                                                f"AND status = 'heldout' AND stratum = '{words[0].name}'").to_pylist()]
    ids = sorted(r["prompt_id"] for r in sql(store, "SELECT prompt_id FROM pool WHERE run_id = 'ev-uniform-s0' AND "
                                                    "round = 0 AND status = 'heldout'").to_pylist())
    keep = np.array([p not in never for p in ids])
    assert ev.without_never_solved["default"][0].mean == pytest.approx(
        np.mean([x["default", s][keep].mean() for s in (0, 1)]))
    # matched steps per pair: the smaller reach of the pair's runs; seconds: generation and training only
    steps = {run: sql(store, f"SELECT count(*) AS n FROM train_steps WHERE run_id = '{run}'").to_pylist()[0]["n"]
             for run in runs.values()}
    assert dec.pairs["steps"].budget == min(steps.values())
    for run in runs.values():
        c = ev.curves[run]
        for v, work, wall in zip(c.versions, c.costs["work_seconds"], c.costs["seconds"]):
            trained = sql(store, f"SELECT coalesce(sum(seconds), 0) AS s FROM train_steps WHERE run_id = '{run}' "
                                 f"AND round < {v}").to_pylist()[0]["s"]
            assert trained <= work + 1e-6 and work <= wall + 1e-6  # holds the training, not the evaluations
    # the token exchange: uniform's tokens over default's for the same mean pass@1, read off a dense grid of each
    # run's own curve (first crossing) rather than tasks/core/curves.py's segment search
    grid = np.arange(0, budget + 1, dtype=float)
    for s, got in zip((0, 1), dec.exchange):
        a, b = (ev.curves[runs[arm, s]] for arm in ("default", "uniform"))
        a_curve, b_curve = (np.interp(grid, c.costs["tokens"], c.pass1.mean(axis=1)) for c in (a, b))
        level = min(a_curve[-1], b_curve[-1]) - 1e-12  # the lower figure, each run's first crossing of it
        first_a, first_b = grid[np.argmax(a_curve >= level)], grid[np.argmax(b_curve >= level)]
        assert got == pytest.approx(first_b / first_a, rel=2e-3, abs=2e-3)
    assert dec.exchange_median == pytest.approx(np.median(dec.exchange)) and ev.decisions["uniform"].exchange == []
    assert dec.train_tokens == pytest.approx(np.mean([
        sql(store, f"SELECT sum(n_tokens) AS n FROM train_steps WHERE run_id = '{runs['default', s]}'").to_pylist()[0]["n"]
        for s in (0, 1)]))


@pytest.mark.slow
def test_the_external_set_is_scored_at_the_budget_milestone_and_read_there(milestoned):
    from flows.compare import budget_checkpoint

    store, planned, _, _, _ = milestoned
    for i, r in enumerate(planned):
        marks = sql(store, f"SELECT milestone AS m, policy_version AS v FROM evals WHERE run_id = '{r.run_id}' AND "
                           f"split = 'heldout' AND milestone > 0 AND milestone <= {MS_BUDGET} ORDER BY m").to_pylist()
        assert budget_checkpoint(store, r.run_id, MS_BUDGET) == marks[-1]["v"]
        last = sql(store, f"SELECT max(policy_version) AS v FROM checkpoints WHERE run_id = '{r.run_id}'").to_pylist()[0]["v"]
        scored = {x["v"] for x in sql(store, f"SELECT DISTINCT policy_version AS v FROM eval_results WHERE run_id = "
                                             f"'{r.run_id}' AND split = 'dataset:ext'").to_pylist()}
        assert scored == {marks[-1]["v"], last} | ({0} if i == 0 else set())
    assert budget_checkpoint(store, planned[0].run_id, MS_BUDGET - 1) is None  # no milestone inside 999 tokens
    ev = build(store, "ev", planned, ["ext"])
    assert ev.external_at == {"ext": "matched"}
    run = planned[1].run_id  # default, seed 0
    v, _ = _at_milestone(store, run, ev.budgets["tokens"])
    rows = sql(store, f"SELECT n_correct / n_samples AS p FROM eval_results WHERE run_id = '{run}' AND "
                      f"split = 'dataset:ext' AND policy_version = {v} ORDER BY prompt_id").to_pylist()
    default = next(f for f in ev.arms if f.arm == "default")
    assert default.external["ext"]["all"][0].seeds == 2 and rows
    page = markdown(ev, ["ext"], "# header", "## design")
    assert "External set `ext`: pass@1 of each run's checkpoint at the matched budget" in page


def test_the_component_table_names_an_arm_the_governor_never_measured_and_is_left_out_when_nothing_spent():
    """An arm run with the governor off has no `governor` rows: it is named under the table rather than missing
    from it silently; a page whose components never generated a token has no component section at all."""
    from types import SimpleNamespace

    from tasks.compare.sections import yield_lines

    arms = [SimpleNamespace(arm="default", run_ids=["ev-default-s0"]), SimpleNamespace(arm="off", run_ids=["ev-off-s0"])]
    rows = pl.DataFrame({"run_id": ["ev-default-s0"], "component": ["shape"], "rounds_active": [2], "tokens": [500],
                         "rows": [2.0], "yield_sum": [8.0], "baseline_sum": [60.0], "rounds_below": [2],
                         "rounds_throttled": [1]})
    lines = yield_lines(SimpleNamespace(arms=arms, yields=rows))
    assert "| `default` | shape | 500 | 4.0 | 30.0 | 2 / 2 | 1 |" in lines
    assert lines[-2:] == ["Below plain rollouts' yield on average: `default`'s shape (4.0 against 30.0).",
                          "No governor rows (governor off, or runs made before it): `off`."]
    idle = rows.with_columns(rounds_active=pl.lit(0), yield_sum=pl.lit(None), baseline_sum=pl.lit(None))
    assert yield_lines(SimpleNamespace(arms=arms, yields=idle)) == []


@pytest.mark.slow
def test_the_component_yields_are_the_governors_per_round_means():
    """The page's component table against the `governor` rows directly, on the committed v2 comparison (real
    runs of the embedded policy: refinement and shaping spent tokens there): per arm and component, tokens per
    run and the means of its and plain rollouts' yields over the rounds it generated in; `uniform` spends
    nothing on top of plain rollouts, so it has no line."""
    from flows.compare import plan
    from storage.store import Store

    store = Store(Path(__file__).parent.parent / "benchmarks" / "evidence-v2" / "store")
    planned = plan(["uniform", "default"], 4, "ev", [], {})
    page = markdown(build(store, "ev", planned, []), [], "# header", "## design")
    section = page[page.index("### What each token-spending component made"):]
    section = section[:section.index("\n#")]
    gov = pl.from_arrow(sql(store, "SELECT * FROM governor WHERE starts_with(run_id, 'ev-default-')"))
    active = gov.filter((pl.col("tokens") > 0) & pl.col("baseline_per_1k").is_not_null())
    assert active.height  # v2's default runs refined and shaped
    seeds = sum(r.arm == "default" for r in planned)
    short = []
    for (component,), rows in active.group_by("component"):
        own, base = rows["yield_per_1k"].mean(), rows["baseline_per_1k"].mean()
        below = int((rows["yield_per_1k"] < rows["baseline_per_1k"]).sum())
        throttled = gov.filter((pl.col("component") == component) & pl.col("throttled")).height
        assert (f"| `default` | {component} | {rows['tokens'].sum() / seeds:.0f} | {own:.1f} | {base:.1f} | "
                f"{below} / {rows.height} | {throttled} |") in section
        short += [component] if own < base else []
    assert "| `uniform` |" not in section and "No governor rows" not in section  # uniform's rows are all idle
    assert all(f"`default`'s {c} (" in section for c in short)
    assert section.count("`default`'s ") == len(short) and ("none." in section) == (not short)


@pytest.mark.slow
def test_runs_made_in_two_stores_at_once_merge_into_the_comparison(milestoned, tmp_path, capsys):
    """`--run --only` in two stores (as two cores would), then `--merge-from`: the merged store holds every run
    and its page reads the same held-out pass@1, per arm and at each milestone, as the comparison run in one
    store (the `milestoned` fixture); merging again copies nothing."""
    from storage.store import Store

    evidence = _evidence_script()
    store, planned, sets, design, data = milestoned
    args = ["--arms", "uniform,default", "--seeds", "2", "--config", str(design), "--dataset", str(data),
            *[x for s in [*sets, "rounds=4"] for x in ("--set", s)]]  # the fixture's compare(..., rounds=4)
    a, b = tmp_path / "a", tmp_path / "b"
    assert evidence.main(["--store", str(a), *args, "--run", "--only", "ev-uniform-s0,ev-default-s0"]) == 0
    assert "2 planned run(s) not in " in capsys.readouterr().out  # a part, as asked: no page
    assert evidence.main(["--store", str(b), *args, "--run", "--only", "ev-default-s1,ev-uniform-s1"]) == 0
    assert evidence.finished(Store(b), [r.run_id for r in planned]) == {"ev-uniform-s1", "ev-default-s1"}
    capsys.readouterr()
    c = tmp_path / "c"  # runs of another design (here: without the scripted overrides) are refused uncopied
    assert evidence.main(["--store", str(c), *args[:8], "--merge-from", str(b)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("evidence: ev-uniform-s1 was not run with this design") and err.count("\n") == 1
    assert not (c / "rollouts").exists()
    out = tmp_path / "page.md"
    assert evidence.main(["--store", str(a), *args, "--merge-from", str(b), "--out", str(out)]) == 0
    assert "evidence: merged 2 run(s) from " in capsys.readouterr().out and out.exists()
    merged, whole = build(Store(a), "ev", planned, ["ext"]), build(store, "ev", planned, ["ext"])
    def figures(ev):  # wall-clock seconds differ between any two runs; the rest is the same computation
        return [(f.arm, f.run_ids, f.at["tokens"], f.at["steps"], f.last, f.informative,
                 {k: v for k, v in f.purposes.items() if k != "eval"}) for f in ev.arms], ev.base_model

    assert figures(merged) == figures(whole)
    # except evaluation's tokens (never counted in the budget): the second store scored the base model itself
    assert merged.arms[0].purposes["eval"] > whole.arms[0].purposes["eval"]
    assert [f.purposes["eval"] for f in merged.arms[1:]] == [f.purposes["eval"] for f in whole.arms[1:]]
    for run_id, curve in whole.curves.items():
        assert merged.curves[run_id].costs["tokens"] == curve.costs["tokens"]
        assert np.array_equal(merged.curves[run_id].pass1, curve.pass1)
    assert evidence.main(["--store", str(a), *args, "--merge-from", str(b), "--out", str(out)]) == 0
    assert "evidence: merged 0 run(s)" in capsys.readouterr().out


@pytest.mark.slow
def test_evidence_json_for_the_calibration_arms(milestoned, tmp_path, capsys):
    evidence = _evidence_script()
    store, planned, sets, design, data = milestoned
    args = ["--store", store.root, "--arms", "uniform,default", "--seeds", "2", "--config", str(design),
            "--dataset", str(data), *[x for s in sets for x in ("--set", s)]]
    assert evidence.main([*args, "--estimate"]) == 0
    assert "4 planned run(s), 4 finished, 0 to run" in capsys.readouterr().out
    out = tmp_path / "evidence.md"
    assert evidence.main([*args, "--budgets", f"{HALF},1000000", "--out", str(out),
                          "--json", str(tmp_path / "e.json")]) == 0
    figures = json.loads((tmp_path / "e.json").read_text())
    ev = build(store, "ev", planned, ["ext"], design_budgets=[HALF, 10**6])
    default = figures["arms"]["default"]
    want = ev.decisions["default"]
    assert default["pass1_at_budget"] == pytest.approx(next(f for f in ev.arms if f.arm == "default").at["tokens"].mean)
    assert default["vs_uniform"][0] == pytest.approx(np.mean(want.test.d)) and len(default["vs_uniform"]) == 3
    assert default["relative_vs_uniform"] == pytest.approx(np.mean(want.test.d) / want.test.base_mean)
    assert (default["seed_test_p"], default["paired_seeds"], default["power_seeds_needed"]) == (
        want.test.p, 2, want.test.power_seeds)
    assert default["informative_ratio"] == figures["default_informative"]
    assert default["pass1_at"] == {str(HALF): pytest.approx(want.at_design[HALF].mean), "1000000": None}
    assert default["token_exchange"] == pytest.approx(want.exchange_median)
    assert default["token_exchange_per_seed"] == pytest.approx(want.exchange)
    assert figures["arms"]["uniform"]["token_exchange"] is None
    assert figures["arms"]["uniform"]["seed_test_p"] is None and figures["arms"]["uniform"]["vs_uniform"] is None
    strata = figures["heldout_strata"]
    assert sum(s["prompts"] for s in strata.values()) == figures["heldout_prompts"]
    assert [name.endswith("words.jsonl") for name, s in strata.items() if s["never_solved"]] == [True]
    assert figures["external_checkpoint"] == {"ext": "matched"}
    page = out.read_text()
    for line in ("### The seed-level test beside the bootstrap", "**(never solved)**", "Totals with and without the "
                 "never-solved strata", "| not reached |", "### Matched steps and seconds per pair",
                 "| training tokens |", "### Token exchange against `uniform`", "--arms uniform,default --seeds 2",
                 "Arms `uniform`, `default` at 2 paired seed(s)", "`default` >= `uniform` + 10% relative",
                 f"the seed-level paired test significant at 5% (sign-flip p {want.test.p:.3f} over 2 seeds)"):
        assert line in page, line
    assert "| `default` | `rollout.lope_prefixes=0` |" in page


def test_the_readme_evidence_paragraph_quotes_the_page():
    """Every interval and count README's evidence paragraph quotes is on docs/evidence.md (README writes a
    minus as −, the page as -)."""
    import re

    root = Path(__file__).parent.parent
    readme = (root / "README.md").read_text(encoding="utf-8")
    para = readme[readme.index("**The evidence does not yet favour"):readme.index("```bash")].replace("−", "-")
    page = (root / "docs" / "evidence.md").read_text(encoding="utf-8")
    quoted = re.findall(r"[+-]?\d\.\d{3} \[[+-]?\d\.\d{3}, [+-]?\d\.\d{3}\]", para)
    assert len(quoted) >= 4
    missing = [q for q in quoted if q not in page]
    assert not missing, f"README quotes figures the page does not print: {missing}"
    runs, hours = re.search(r"(\d+) runs, (\d+\.\d) hours", para).groups()
    assert f"In all: {runs} runs, {hours} hours" in page
    prompts, samples = re.search(r"(\d+) held-out prompts x (\d+) samples", para).groups()
    assert f"({prompts} prompts x {samples} samples)" in page


@pytest.mark.slow  # about 60 stored runs' configs against their designs
def test_the_readme_commands_fit_their_committed_stores_designs():
    """Each README command that regenerates a committed page passes the page's design check on its store (v1's and
    v2's designs once left `select.batch_size` to the default, which became 16 after their runs at 48, and their
    commands stopped at that check; the committed-pages test below reads the stores without it)."""
    import shlex

    from flows.compare import plan
    from storage.store import Store

    evidence = _evidence_script()
    root = Path(__file__).parent.parent
    readme = (root / "README.md").read_text(encoding="utf-8")
    block = readme[readme.index("The commands that regenerate each committed page"):]
    block = block[block.index("```bash") + 7:block.index("```", block.index("```bash") + 7)]
    commands = [c for c in block.replace("\\\n", " ").splitlines() if "benchmarks/evidence.py" in c]
    assert len(commands) == 4
    seen = []

    def capture(a):
        groups, _ = evidence._groups(a)
        planned = [r for arms, seeds in groups for r in plan(arms, seeds, evidence.PREFIX, a.set, {})]
        evidence.check_design(Store(root / a.store), planned, str(root / a.config), [])
        seen.append(a.store)
        return 0

    evidence._main = capture
    for command in commands:
        args = shlex.split(command.split("#")[0])
        assert evidence.main(args[args.index("benchmarks/evidence.py") + 1:]) == 0, command
    assert sorted(seen) == ["benchmarks/evidence-v2/store", "benchmarks/evidence-v3/store",
                            "benchmarks/evidence-v5/store", "benchmarks/evidence/store"]


@pytest.mark.slow
@pytest.mark.parametrize("page,store,arms,datasets,line", [
    ("evidence-v1.md", "evidence", None, ["reasoning_gym_ood"], "| `refinery` | 3 | -0.059, -0.119, -0.127 |"),
    ("evidence-v2.md", "evidence-v2", (["uniform", "default"], 4), ["reasoning_gym_ood", "in_family_harder"],
     "| `default` | 4 | +0.007, -0.035, +0.030, +0.002 |"),
    ("evidence-v3.md", "evidence-v3", (["uniform", "default", "default_thompson"], 8),
     ["reasoning_gym_ood", "in_family_harder"],
     "| `default` | 8 | +0.012, -0.050, +0.040, -0.017, +0.020, -0.032, -0.035, -0.052 |"),
    ("evidence.md", "evidence-v5", (["uniform", "default"], 8), ["reasoning_gym_ood", "in_family_harder"],
     "| `default` | 8 | +0.007, -0.005, -0.030, +0.032, +0.022, -0.030, +0.020, +0.035 |")])
def test_the_committed_stores_regenerate_the_committed_pages_figures(page, store, arms, datasets, line):
    """Each committed page's verdict and every table are what its committed store gives today (README's
    commands): a change to how a figure is computed shows here before the page goes stale."""
    from flows.compare import plan
    from storage.store import Store

    evidence = _evidence_script()
    root = Path(__file__).parent.parent
    groups = [arms] if arms else evidence.arm_groups(3, 1, ["no_lope"])
    planned = [r for names, n in groups for r in plan(names, n, "ev", [], {})]
    ev = build(Store(root / "benchmarks" / store / "store"), "ev", planned, datasets,
               design_budgets=list(evidence.BUDGETS))
    body = markdown(ev, datasets, "# header", "## design")
    text = (root / "docs" / page).read_text(encoding="utf-8")
    verdict = body[body.index("## Result against the goal"):body.index("## Tables")].strip()
    tables = body[body.index("## Tables"):body.index("## Curves")]
    assert verdict in text and tables in text
    assert line in tables  # the seed-level line of the headline arm


def test_a_folder_for_the_page_or_its_json_is_refused_before_any_run(tmp_path, capsys):
    """The page is written after hours of runs: --out or --json naming a folder is a one-line error at the start."""
    script = _evidence_script()
    for flag in ("--out", "--json"):
        code = script.main(["--store", str(tmp_path / "store"), "--run", flag, str(tmp_path)])
        err = capsys.readouterr().err
        assert code == 2 and f"{flag} {tmp_path} is a folder" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "store").exists()
