"""The Sampler (flows/sampler.py) steering an external training loop: examples/sampler_grpo.py (plain-torch
GRPO on the tiny model) is SIGKILLed after a round's observation landed and before its own checkpoint, then
started again with the same command; the batches its model trained on are the store's rounds, in order, none
repeated and none skipped. Also what the sampler refuses."""

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import kill_at_flag, q, run_cli

from flows.sampler import Sampler
from storage.runs import RunLocked

REPO = Path(__file__).resolve().parent.parent
SETS = ["model.policy=tiny-random", "select.embedder=hashing", "refine.strategies=[\"ladder\"]",
        'pool.sources=[{"source": "rg:products", "size": 6, "params": {"max_digits": 1}}, '
        '{"source": "rg:chain_sum", "size": 4, "params": {"max_terms": 2, "max_digits": 1}}]']


def loop(store, ckpt, env=None):
    args = [sys.executable, str(REPO / "examples" / "sampler_grpo.py"), "--store", store.root, "--run-id", "ext",
            "--checkpoint", str(ckpt), "--steps", "3", "--batch", "3", "--group", "2", "--max-new-tokens", "4"]
    for s in SETS:
        args += ["--set", s]
    return subprocess.Popen(args, cwd=REPO, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_a_killed_loop_resumes_on_the_same_batches(store, tmp_path):
    import torch

    ckpt, flag = tmp_path / "loop.pt", tmp_path / "reached"
    proc = loop(store, ckpt, {"REFINERY_FAULT": "sampler:observed:1", "REFINERY_FAULT_FLAG": str(flag)})
    kill_at_flag(proc, flag, "the sampler loop's fault point")
    # killed between round 1's landed observation and the loop's checkpoint of step 1
    assert torch.load(ckpt, weights_only=False)["step"] == 1 and store.landed("ext", 1, "score")

    proc = loop(store, ckpt)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "resumed at step 1 (sampler round 1)" in out
    history = torch.load(ckpt, weights_only=False)["history"]
    drawn = {}
    for r in q(store, "SELECT round, prompt_id FROM selections WHERE run_id = 'ext' ORDER BY round, prompt_id"):
        drawn.setdefault(r["round"], []).append(r["prompt_id"])
    assert [sorted(h) for h in history] == [drawn[r] for r in range(3)] and len(drawn) == 3
    # each round landed once: one group of 2 per batch prompt, whatever the rerun generated
    counts = q(store, "SELECT round, count(*) AS n, count(DISTINCT prompt_id) AS p, count(DISTINCT sample_idx) AS k, "
                      "count(DISTINCT augmentation) AS a FROM rollouts WHERE run_id = 'ext' GROUP BY round ORDER BY round")
    assert counts == [{"round": r, "n": 6, "p": 3, "k": 2, "a": 6} for r in range(3)]
    assert [r["status"] for r in q(store, "SELECT status FROM runs WHERE run_id = 'ext' ORDER BY created_at")] == [
        "running", "failed", "resumed", "completed"]  # the dead loop's run is found failed by its successor
    # the rounds are a run like any other: scored, and refined where too hard
    assert q(store, "SELECT count(DISTINCT round) AS n FROM prompt_scores WHERE run_id = 'ext'") == [{"n": 3}]


def test_what_the_sampler_refuses(store, tmp_path):
    for extra, message in (("select.selector=dapo_filter", "dapo_filter oversamples"),
                           ("select.selector=all", "draws the whole pool"),
                           ("select.embedder=policy", "embedder policy")):
        with pytest.raises(ValueError, match=message):
            Sampler(store.root, "x", sets=[*SETS, extra])
    with Sampler(store.root, "x", sets=SETS) as s:
        with pytest.raises(RunLocked, match="already running"):
            Sampler(store.root, "x", sets=SETS)  # one loop per run id
        with pytest.raises(ValueError, match="no batch yet"):
            s.observe(["p"], [1.0])
        batch = s.next_batch(2)
        assert len(batch) == 2 and s.next_batch(2) == batch  # a drawn round is served again as drawn
        with pytest.raises(ValueError, match="drawn with 2 prompts; next_batch\\(3\\)"):
            s.next_batch(3)
        ids = [b["prompt_id"] for b in batch]
        with pytest.raises(ValueError, match=f"batch prompt {ids[1]} has no completion"):
            s.observe(ids[:1], [1.0])
        with pytest.raises(ValueError, match="not in round 0's batch"):
            s.observe(["nope"], [1.0])
        with pytest.raises(ValueError, match="2 prompt_ids but 1 rewards"):
            s.observe(ids, [1.0])
        with pytest.raises(ValueError, match="not a finite number"):
            s.observe(ids, [1.0, float("nan")])
        with pytest.raises(ValueError, match="state is of run 'y'"):
            s.load_state_dict({"run_id": "y", "round": 0})
        with pytest.raises(ValueError, match="never observed"):
            s.load_state_dict({"run_id": "x", "round": 5})
        assert not store.landed("x", 0, "collect")  # nothing landed by the refused calls
        s.observe(ids, [1.0, 0.0])
        assert s.state_dict() == {"run_id": "x", "round": 1}
        s.load_state_dict({"run_id": "x", "round": 0})  # a loop resumed from an older checkpoint replays round 0
        assert s.next_batch(2) == batch
        with pytest.raises(ValueError, match=f"observed before with 1 completions of prompt {ids[0]}, now 2"):
            s.observe([ids[0], ids[0], ids[1]], [1.0, 0.0, 1.0])
        s.observe(ids, [0.0, 0.0])  # lands nothing: the first observation stands
        assert q(store, "SELECT sum(reward) AS r FROM rollouts WHERE run_id = 'x'") == [{"r": 1.0}]
        nxt = s.next_batch(2)
        # the drawn, not yet observed round exports as the next batch
        code, _, err = run_cli("export", "x", str(tmp_path / "next.parquet"), "--store", store.root)
        assert code == 0, err
        exported = pq.read_table(tmp_path / "next.parquet").to_pylist()
        assert sorted(r["prompt_id"] for r in exported if r["selected"]) == sorted(b["prompt_id"] for b in nxt)
    with pytest.raises(ValueError, match="was sampled with another config"):
        Sampler(store.root, "x", sets=[*SETS, "select.selector=uniform"])
    # a sampler's run has no checkpoints: eval and rescore refuse it by name, and skip it as the newest run
    from flows.evaluate import latest_run, run_config

    with pytest.raises(ValueError, match="made by an external loop's sampler .*, not `refinery run`"):
        run_config(store, "x", "evaluate")
    with pytest.raises(ValueError, match="no runs of `refinery run`"):
        latest_run(store)


def test_a_refinery_run_id_is_not_a_samplers(store):
    from storage.runs import mark

    mark(store, "mine", "completed", {"rounds": 2})
    with pytest.raises(ValueError, match="exists and was not made by a sampler"):
        Sampler(store.root, "mine", sets=SETS)


def test_a_run_sampled_before_a_default_changed_resumes(store):
    """A sampler run stored by an older version (its strategies without soften, which joined the defaults later,
    and a config without a field added since) resumes under today's defaults with its own strategies."""
    from flows.config import load_config
    from storage.runs import mark

    sets = [s for s in SETS if not s.startswith("refine.strategies")]
    old = {**load_config(None, sets, run_id="old", store=store.root).model_dump(mode="json"),
           "sampler": {"correct_at": 1.0}}
    old["refine"]["strategies"] = ["ladder", "teacher_scaffold", "hint_prefix", "harden"]
    del old["rollout"]["screen_samples"]  # stored before screening existed
    mark(store, "old", "running", old)
    with Sampler(store.root, "old", sets=sets) as s:
        assert s.config.refine.strategies == ["ladder", "teacher_scaffold", "hint_prefix", "harden"]
    with pytest.raises(ValueError, match="was sampled with another config"):  # a change the user asked for
        Sampler(store.root, "old", sets=[*sets, 'refine.strategies=["ladder"]'])


def test_the_sampler_draws_only_the_named_strata(store):
    """select.strata holds in a sampled run as in the curriculum flow: the sampler's pool records its strata
    (nothing held out) and the batch comes from the named one."""
    sums = "rg:chain_sum{max_digits=1,max_terms=2}"
    with Sampler(store.root, "st", sets=[*SETS, f'select.strata=["{sums}"]']) as s:
        batch = s.next_batch(3)
    assert len(batch) == 3 and {b["source"] for b in batch} == {"rg:chain_sum"}
    assert q(store, "SELECT DISTINCT stratum, status FROM pool WHERE run_id = 'st' AND prompt_id IN "
                    "(SELECT prompt_id FROM selections WHERE run_id = 'st')") == [{"stratum": sums, "status": "active"}]
