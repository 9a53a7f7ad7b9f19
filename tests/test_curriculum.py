"""End-to-end curriculum runs on the tiny model, and resume after a SIGKILL mid-collection."""

import contextlib
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import kill_at_flag

from flows.config import load_config
from storage.query import sql
from storage.store import Store

TINY = ["model.policy=tiny-random", "model.dtype=fp32", "rollout.max_new_tokens=4", "rollout.group_size=4",
        "rollout.include_reserve=true", "select.embedder=hashing", "select.batch_size=6",
        "refine.teacher_max_new_tokens=16", "rollout.lope_prefixes=6", "rollout.lope_max_groups=2",
        "rollout.screen_samples=0",  # B groups of G per round: the flow's rows, not screening's (test_screening.py)
        "shape.enabled=true",  # off by default: every stage runs here, and the kill tests stop one mid-shape
        'pool.sources=[{"source": "rg:products", "size": 5, "params": {"max_digits": 1}}, '
        '{"source": "rg:chain_sum", "size": 3, "params": {"max_terms": 2, "max_digits": 1}}]']


# TINY with the policy writing teacher_scaffold rewrites (off by default): the gate must keep its noise out
SELF_TEACHER = [*TINY, "refine.scaffolds_from_policy=true"]


def _counts(store: Store, run: str) -> dict:
    q = f"""SELECT (SELECT count(*) FROM rollouts WHERE run_id = '{run}') AS rollouts,
                   (SELECT count(*) FROM (SELECT DISTINCT round, prompt_id, sample_idx FROM rollouts
                                          WHERE run_id = '{run}')) AS distinct_rollouts,
                   (SELECT count(*) FROM prompt_scores WHERE run_id = '{run}') AS scores,
                   (SELECT count(*) FROM pool WHERE run_id = '{run}') AS pool"""
    return sql(store, q).to_pylist()[0]


def test_two_rounds_on_the_tiny_model(prefect_api, store, monkeypatch):
    from flows.curriculum import curriculum

    out = curriculum(load_config(sets=SELF_TEACHER, run_id="e2e", store=store.root, rounds=2))
    full = ["pool", "govern", "select", "collect", "score", "refine", "shape", "train", "evaluate", "report"]
    assert [s["stage"] for s in out["stages"]] == full + [s for s in full if s != "refine"]
    # the chain of policy versions, one per round, each with its parent, and an evaluation of each
    chain = sql(store, "SELECT policy_version, parent_version, round FROM checkpoints WHERE run_id = 'e2e' "
                       "ORDER BY policy_version").to_pylist()
    assert chain == [{"policy_version": 0, "parent_version": None, "round": 0},
                     {"policy_version": 1, "parent_version": 0, "round": 0},
                     {"policy_version": 2, "parent_version": 1, "round": 1}]
    evals = sql(store, "SELECT round, policy_version, n_prompts, k, pass_at_1 FROM evals WHERE run_id = 'e2e' "
                       "ORDER BY round, policy_version").to_pylist()
    assert [(e["round"], e["policy_version"]) for e in evals] == [(0, 0), (0, 1), (1, 2)]
    assert all(e["n_prompts"] == 2 and e["k"] == 1 for e in evals)  # greedy, the default: pass@k is pass@1
    # every rollout keeps the ids its sampler drew (end token included when it stopped) and their log-probs,
    # whose mean is the stored mean_logprob over the tokens before the end
    kept = sql(store, "SELECT count(*) AS n, count(*) FILTER (WHERE len(token_ids) = n_tokens "
                      "+ (finish_reason = 'stop')::INT AND len(token_logprobs) = len(token_ids) AND (n_tokens = 0 OR abs(list_sum("
                      "token_logprobs[1:n_tokens]) / n_tokens - mean_logprob) < 1e-4)) AS ok FROM rollouts "
                      "WHERE run_id = 'e2e'").to_pylist()[0]
    assert kept["n"] > 0 and kept["ok"] == kept["n"], kept
    # version 0's numbers are what the same sampling and the verifier give on the held-out prompts
    from models.backend import Sampling
    from models.registry import load_backend
    from tasks.core.heldout import pass_at_k
    from tasks.core.rewards import verify
    from tasks.evaluate import heldout_prompts

    cfg = load_config(sets=TINY)
    held = heldout_prompts(store, "e2e").to_dicts()
    base = load_backend("tiny-random", "transformers", cfg.model.device, cfg.model.dtype, cfg.model.batch_size)
    groups = base.generate([base.render([{"role": "user", "content": f"{h['text']}\n{cfg.rollout.instruction}"}])
                            for h in held], 4, Sampling(cfg.eval.temperature, 1.0, cfg.rollout.max_new_tokens, 0))
    solved = [sum(verify(c.text, h["answer"], h["source"], h["text"], h["meta"]).correct for c in g)
              for h, g in zip(held, groups)]
    assert evals[0]["pass_at_1"] == pytest.approx(sum(solved) / 8)
    assert sql(store, "SELECT pass_at_k FROM evals WHERE run_id = 'e2e' AND policy_version = 0").to_pylist()[0][
        "pass_at_k"] == pytest.approx(sum(pass_at_k(4, c, 4) for c in solved) / 2)
    # round 1 sampled version 1; the held-out prompts were never collected
    assert sql(store, "SELECT DISTINCT round, policy_version FROM rollouts WHERE run_id = 'e2e' ORDER BY 1"
               ).to_pylist() == [{"round": 0, "policy_version": 0}, {"round": 1, "policy_version": 1}]
    import contextlib
    import io

    from flows.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["eval", "--run-id", "e2e", "--checkpoint", "1", "--store", store.root]) == 0
    lines = buf.getvalue().splitlines()  # the flow's own round-0 evaluation of v1, reported, not resampled
    assert len(lines) == 1 and "v1 (round 0, heldout, 2 prompts): pass@1" in lines[0]
    assert not store.landed("e2e", 0, "eval-v1")
    assert sql(store, """SELECT count(*) AS n FROM evals WHERE run_id = 'e2e' AND policy_version = 1
                         AND split = 'heldout'""").to_pylist() == [{"n": 1}]
    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert main(["eval", "--run-id", "e2e", "--checkpoint", "7", "--store", store.root]) == 1
    assert "no checkpoint 7; it has 0, 1, 2" in err.getvalue()
    assert sql(store, """SELECT count(*) AS n FROM rollouts r JOIN pool p ON p.prompt_id = r.prompt_id
                         AND p.run_id = r.run_id AND p.status = 'heldout'""").to_pylist() == [{"n": 0}]
    per_prompt = sql(store, """SELECT r.round, r.prompt_id, count(*) AS n, any_value(s.bucket) AS bucket,
                                      any_value(s.eps) AS eps, min(r.reward) AS lo, max(r.reward) AS hi
                               FROM rollouts r JOIN prompt_scores s USING (run_id, round, prompt_id)
                               GROUP BY ALL""").to_pylist()
    assert len(per_prompt) == 2 * 6 and all(r["n"] == 4 for r in per_prompt)
    for r in per_prompt:  # each bucket is the one its group's rewards make (tau = 0, tolerance 1e-6)
        varied = r["hi"] - r["lo"] > 1e-6
        want = ("informative" if varied and r["eps"] > 0 else "saturated" if r["lo"] >= 1 - 1e-6
                else "too_hard" if r["hi"] <= 1e-6 else "flat")
        assert r["bucket"] == want and (r["eps"] > 0) == (want == "informative") and r["eps"] >= 0, r
    statuses = sql(store, "SELECT status FROM runs WHERE run_id = 'e2e' ORDER BY created_at").column("status")
    assert statuses.to_pylist() == ["running", "completed"]
    # rerunning a finished run lands nothing new
    again = curriculum(load_config(sets=SELF_TEACHER, run_id="e2e", store=store.root, rounds=2))
    assert all("skipped" in s for s in again["stages"] if s["stage"] != "report")  # the report is redrawn
    counts = _counts(store, "e2e")
    assert counts["rollouts"] == counts["distinct_rollouts"] == 48 and counts["scores"] == 12
    children = sql(store, "SELECT count(*) AS n FROM refinements WHERE run_id = 'e2e' AND accepted").to_pylist()[0]["n"]
    assert children > 0 and counts["pool"] == 8 + 8 + children  # round 1's pool holds the accepted children
    # the tiny model's rewrites are random tokens: the gate accepts none, and says why per category in SQL
    rewrites = sql(store, """SELECT accepted, split_part(reason, ':', 1) AS category, count(*) AS n
                             FROM refinements WHERE run_id = 'e2e' AND strategy = 'teacher_scaffold'
                             GROUP BY ALL""").to_pylist()
    assert sum(r["n"] for r in rewrites) > 0 and not any(r["accepted"] for r in rewrites)
    assert {r["category"] for r in rewrites} <= {"drops quantities", "not language", "off topic", "echoes prompt",
                                                  "reveals answer", "too short", "unchanged"}
    # 2 of the 8 roots are held out (eval.heldout_fraction 0.2 of 8, rounded), in both rounds
    assert sql(store, "SELECT round, count(*) AS n FROM pool WHERE run_id = 'e2e' AND status = 'heldout' "
                      "GROUP BY 1 ORDER BY 1").to_pylist() == [{"round": 0, "n": 2}, {"round": 1, "n": 2}]
    # lineage: a refined root shows its children, with per-round scores and statuses
    import json as _json

    from flows.cli import main

    parent = sql(store, "SELECT parent_id FROM refinements WHERE run_id = 'e2e' AND accepted LIMIT 1").to_pylist()[0]
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["lineage", parent["parent_id"], "--json", "--store", store.root]) == 0
    tree = _json.loads(buf.getvalue())
    pid = parent["parent_id"]
    scored = sql(store, f"SELECT round, bucket FROM prompt_scores WHERE prompt_id = '{pid}' ORDER BY 1").to_pylist()
    assert [(r["round"], r["bucket"]) for r in tree["prompt"]["rounds"]] == [(r["round"], r["bucket"]) for r in scored]
    assert scored[0]["bucket"] in ("too_hard", "flat", "saturated")  # only those are refined
    children = sql(store, f"""SELECT child_id, arg_max(p.status, p.round) AS status FROM refinements f
                              JOIN pool p ON p.run_id = f.run_id AND p.prompt_id = f.child_id
                              WHERE f.parent_id = '{pid}' AND f.accepted GROUP BY 1""").to_pylist()
    assert tree["descendants"] and all(d["parent_id"] == pid for d in tree["descendants"])
    assert {d["prompt_id"]: d["status"] for d in tree["descendants"]} == {c["child_id"]: c["status"] for c in children}
    with pytest.raises(ValueError, match="differs in: rollout"):
        curriculum(load_config(sets=[*SELF_TEACHER, "rollout.temperature=1.0"], run_id="e2e", store=store.root))
    # where no held-out numbers landed for a version (a run stopped before its evaluate stage), `eval` samples
    # them itself as stage eval-v<N>, with the flow's config and seed: the numbers the flow's own evaluation has
    import tasks.evaluate
    from flows.evaluate import evaluate

    monkeypatch.setattr(tasks.evaluate, "landed_heldout", lambda *_: {})
    again = evaluate(run_id="e2e", checkpoint=1, store=store.root)
    assert store.landed("e2e", 0, "eval-v1") and "skipped" not in again["stage"]
    fields = ("round", "split", "n_prompts", "k", "pass_at_1", "pass_at_k")
    first, second = ({f: e[f] for f in fields} for e in again["evals"] if e["split"] == "heldout")
    assert first == second


# TINY plus six prompts with reference solutions: the shape stage turns those into SFT traces, so the tiny
# model (which never answers correctly, so every GRPO group has zero variance) still takes training steps.
SOLVED = str(Path(__file__).parent / "data" / "solved.jsonl")
WITH_TRAINING = [*TINY[:-1], TINY[-1][:-1] + f', {{"source": "{SOLVED}"}}]']

RUN = """
import sys
sys.path.insert(0, "tests")
from flows.config import load_config
from flows.curriculum import curriculum
from test_curriculum import TINY, WITH_TRAINING
sets = WITH_TRAINING if sys.argv[3] == "train" else TINY
curriculum(load_config(sets=sets, run_id=sys.argv[2], store=sys.argv[1], rounds=2))
"""


def _run(store: Store, run_id: str, env: dict | None = None, sets: str = "tiny") -> subprocess.Popen:
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value() or "", **(env or {})}
    return subprocess.Popen([sys.executable, "-c", RUN, store.root, run_id, sets], env=env,
                            cwd=os.path.dirname(os.path.dirname(__file__)))


def _table_counts(store: Store) -> dict:
    """Rows per table (all of the store) and the landed stage records; `runs` is compared apart."""
    import polars as pl

    from storage.query import scan
    from storage.schemas import TABLES

    counts = {t: scan(store, t).select(pl.len()).collect().item() for t in TABLES if t != "runs"}
    # a teacher stage is named by a digest of its payloads, which name the teacher: in round 1 that is the
    # checkpoint's folder, inside the store, so only their number is comparable between two stores
    landed = sorted("teacher-*" if p.name.startswith("teacher-") else str(p.relative_to(store.root))
                    for p in (Path(store.root) / "_landed").rglob("*.json")
                    if not p.name.startswith(("running", "resumed", "failed", "completed")))
    return {**counts, "landed": landed}


@pytest.fixture(scope="module")
def uninterrupted(prefect_api, tmp_path_factory):
    store = Store(tmp_path_factory.mktemp("clean") / "store")
    assert _run(store, "crash", sets="train").wait(timeout=600) == 0
    assert sql(store, "SELECT count(*) AS n FROM train_steps").to_pylist()[0]["n"] > 0  # so train:mid is reached
    return store


# every point runs in `make test-slow` (CI runs it after `make test`): with its module fixture (an uninterrupted
# 2-round run with training) one point took ~116 s of `make test`'s 8 minutes; tests/test_crash.py keeps
# SIGKILL mid-commit in the everyday suite
@pytest.mark.slow
@pytest.mark.parametrize("point", ["collect:mid", "refine:mid", "shape:mid", "train:mid"])
def test_sigkill_mid_stage_then_resume(prefect_api, uninterrupted, tmp_path, point):
    """SIGKILL the flow process mid-rollout, mid-refine (teacher answers landed, refine not), mid-shape or mid-train;
    rerunning the run id finishes with exactly the rows of an uninterrupted run of the same config."""
    store, flag = Store(tmp_path / "store"), tmp_path / "reached"
    proc = _run(store, "crash", {"REFINERY_FAULT": point, "REFINERY_FAULT_FLAG": str(flag)}, sets="train")
    kill_at_flag(proc, flag, point)
    stage = point.split(":")[0]
    assert store.landed("crash", 0, "score" if stage != "collect" else "pool")
    assert not store.landed("crash", 0, stage)
    if stage == "refine":  # the teacher's answers landed before the kill and are reused, not asked again
        assert _table_counts(store)["teacher_calls"] > 0

    assert _run(store, "crash", sets="train").wait(timeout=600) == 0
    assert _table_counts(store) == _table_counts(uninterrupted)
    counts = _counts(store, "crash")
    assert counts["rollouts"] == counts["distinct_rollouts"] == 48 and counts["scores"] == 12
    statuses = sql(store, "SELECT status, reason FROM runs WHERE run_id = 'crash' ORDER BY created_at").to_pylist()
    assert [s["status"] for s in statuses] == ["running", "failed", "resumed", "completed"]
    assert f"(pid {proc.pid} on " in statuses[1]["reason"]  # the dead holder, found by the resuming process
    # the budget ledger counts what an uninterrupted run counts: a resumed stage generates its work again, and
    # teacher answers a killed attempt already landed count from the cache (tasks/strategies/teacher_calls.py)
    ledger = "SELECT round, stage, purpose, calls, completions, tokens FROM generated_tokens ORDER BY ALL"
    assert sql(store, ledger) == sql(uninterrupted, ledger)
    if stage == "collect":  # the resumed round resampled with the same seed
        got = sql(store, "SELECT round, prompt_id, sample_idx, completion FROM rollouts ORDER BY ALL")
        assert got == sql(uninterrupted, "SELECT round, prompt_id, sample_idx, completion FROM rollouts ORDER BY ALL")


def test_a_second_process_on_a_running_run_id_is_refused(prefect_api, store, tmp_path):
    flag = tmp_path / "reached"
    proc = _run(store, "busy", {"REFINERY_FAULT": "collect:mid", "REFINERY_FAULT_FLAG": str(flag)})
    try:
        deadline = time.time() + 300
        while not flag.exists():
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.1)
        from flows.cli import main

        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(["run", "--run-id", "busy", "--store", store.root, *[f"--set={s}" for s in TINY]])
        assert code == 1
        assert f"run busy is already running (pid {proc.pid} on " in err.getvalue()
        assert sql(store, "SELECT status FROM runs WHERE run_id = 'busy'").column("status").to_pylist() == ["running"]
    finally:
        proc.kill()
        proc.wait()


def test_one_round_on_the_embedded_model(prefect_api, store):
    """The real default policy on real reasoning-gym prompts: it solves some, with sane log-probs."""
    from flows.curriculum import curriculum

    sets = ["rollout.group_size=2", "rollout.max_new_tokens=32", "select.selector=all", "rollout.lope_prefixes=0",
            "shape.enabled=false", "train.enabled=false", "eval.enabled=false",
            'pool.sources=[{"source": "rg:products", "size": 10, "params": {"max_digits": 1}}]']
    curriculum(load_config(sets=sets, run_id="real", store=store.root, rounds=1))
    t = sql(store, """SELECT count(*) AS n, sum(correct::INT) AS solved, max(mean_logprob) AS best_lp,
                             min(n_tokens) AS min_tok, count(DISTINCT prompt_id) AS prompts
                      FROM rollouts WHERE run_id = 'real'""").to_pylist()[0]
    assert t["prompts"] == 10 and t["n"] == 20 and t["min_tok"] >= 1
    assert 1 <= t["solved"] <= 20 and t["best_lp"] < 0
    assert "<|im_start|>assistant" in sql(store, "SELECT any_value(prompt_text) AS p FROM rollouts").to_pylist()[0]["p"]


def test_collect_publishes_a_progress_artifact(prefect_api, store):
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterType

    from flows.curriculum import curriculum

    curriculum(load_config(sets=TINY, run_id="art", store=store.root, rounds=1))

    async def progress_artifacts():
        async with get_client() as client:
            return await client.read_artifacts(artifact_filter=ArtifactFilter(type=ArtifactFilterType(any_=["progress"])))

    arts = asyncio.run(progress_artifacts())
    assert any(a.data == 100.0 and "rollouts" in (a.description or "") for a in arts)
