"""`refinery eval --dataset FILE`: a checkpoint scored on a prompt file the run never saw, landing `evals` under
split `dataset:<name>` and one `eval_results` row per prompt; bad files and name clashes refused in one line.
And the budget ledger: every stage that generates lands its `generated_tokens` with its commit."""

import json

import pytest
from conftest import run_cli as _cli
from test_curriculum import TINY

from flows.config import load_config
from storage.query import sql

# The scripted policy on the tiny model's weights (models/scripted.py): it solves arithmetic at known, mixed
# rates, so a dataset evaluation has correct and wrong samples; no training, so the run's checkpoint is v0.
SETS = [s for s in TINY if not s.startswith("rollout.max_new_tokens")] + [
    "model.backend=scripted", "rollout.max_new_tokens=40", "shape.enabled=false",
    "shape.max_traces=1", "shape.steps=1",  # where an arm turns shaping on (`refinery`: tests/test_compare.py), a little
    "train.enabled=false", "eval.n_samples=8", "eval.k=4", "eval.decoding=sampled"]
QUESTIONS = [("What is 3 + 4?", "7"), ("What is 6 * 7?", "42"), ("What is 9 - 12?", "-3"),
             ("What is 8 * 8 + 1?", "65"), ("Name a colour.", "blue")]  # the last has no expression: never solved


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def run(prefect_api, tmp_path_factory):
    """One seeded 1-round scripted run (collect with LoPE, score, evaluate), shared by the tests here."""
    from flows.curriculum import curriculum
    from storage.store import Store

    store = Store(tmp_path_factory.mktemp("run") / "store")
    cfg = load_config(sets=SETS, run_id="ds", store=store.root, rounds=1)
    return store, cfg, curriculum(cfg)


def test_each_stage_lands_what_it_generated(run):
    store, cfg, out = run
    rows = sql(store, "SELECT stage, purpose, calls, completions, tokens FROM generated_tokens WHERE run_id = 'ds' "
                      "ORDER BY stage, purpose").to_pylist()
    by = {(r["stage"], r["purpose"]): r for r in rows}
    assert set(by) == {("collect", "rollout"), ("collect", "lope"), ("evaluate", "eval")}  # nothing else generates
    n_rollouts = sql(store, "SELECT count(*) AS n FROM rollouts WHERE run_id = 'ds'").to_pylist()[0]["n"]
    assert by["collect", "rollout"]["completions"] == n_rollouts and by["collect", "rollout"]["calls"] == 1
    collect = next(s for s in out["stages"] if s["stage"] == "collect")
    assert by["collect", "lope"]["completions"] == collect["lope"]["resamples"] > 0
    assert by["collect", "rollout"]["tokens"] == collect["tokens"]
    ev = sql(store, "SELECT sum(n_samples) AS n, sum(n_tokens) AS t FROM eval_results WHERE run_id = 'ds'").to_pylist()[0]
    assert (by["evaluate", "eval"]["completions"], by["evaluate", "eval"]["tokens"]) == (ev["n"], ev["t"])
    assert all(r["tokens"] > 0 for r in rows)


def test_a_checkpoint_scored_on_a_prompt_file(run, tmp_path):
    store, cfg, _ = run
    from models.backend import Sampling
    from models.registry import load_model
    from tasks.core.fewshot import ask
    from tasks.core.seeds import round_seed, row_seeds
    from tasks.core.verdicts import verdicts
    from tasks.evaluate import EvalConfig

    path = _write(tmp_path / "arith.jsonl", [{"id": f"q{i}", "question": q, "answer": a}
                                            for i, (q, a) in enumerate(QUESTIONS)])
    code, out, err = _cli("eval", "--run-id", "ds", "--dataset", path, "--store", store.root)
    assert code == 0, err
    assert out.count("\n") == 1 and "v0 (round 0, dataset:arith, 5 prompts): pass@1" in out

    # per prompt: what the same sampling and the verifier give, joined to the landed prompts' text
    rows = sql(store, """SELECT p.text, r.n_samples, r.n_correct, r.n_tokens, p.source FROM eval_results r
                         JOIN prompts p USING (prompt_id) WHERE r.run_id = 'ds' AND r.split = 'dataset:arith'
                         ORDER BY p.text""").to_pylist()
    assert len(rows) == 5 and all(r["n_samples"] == 8 and r["source"] == "arith" for r in rows)
    prompts = sql(store, "SELECT prompt_id, text, answer, source, meta FROM prompts WHERE source = 'arith' "
                         "ORDER BY prompt_id").to_pylist()
    import polars as pl

    frame = pl.DataFrame(prompts)
    backend = load_model(cfg.model)
    groups = backend.generate([backend.render([ask(t, cfg.rollout.instruction)]) for t in frame["text"]], 8,
                              Sampling(cfg.eval.temperature, 1.0, cfg.rollout.max_new_tokens,
                                       round_seed(EvalConfig().seed, 0)),
                              row_seeds=row_seeds(round_seed(EvalConfig().seed, 0), frame["prompt_id"].to_list()))
    want = {t: (sum(v.correct for v in vs), sum(len(c.token_ids) for c in g))
            for t, g, vs in zip(frame["text"], groups, verdicts(frame, groups, cfg.reward))}
    assert {r["text"]: (r["n_correct"], r["n_tokens"]) for r in rows} == want
    assert want["Name a colour."][0] == 0 and 0 < sum(c for c, _ in want.values()) < 4 * 8  # mixed outcomes
    (ev,) = sql(store, "SELECT n_prompts, k, pass_at_1 FROM evals WHERE split = 'dataset:arith'").to_pylist()
    assert ev["n_prompts"] == 5 and ev["pass_at_1"] == pytest.approx(sum(c for c, _ in want.values()) / 40)
    # the run's own held-out evaluation landed per-prompt rows too, apart from the dataset's
    assert sql(store, "SELECT count(*) AS n FROM eval_results WHERE split = 'heldout'").to_pylist()[0]["n"] > 0

    # the same file again: reported, not resampled (no new rows)
    code, again, _ = _cli("eval", "--run-id", "ds", "--dataset", path, "--store", store.root)
    assert code == 0 and again == out
    assert sql(store, "SELECT count(*) AS n FROM eval_results WHERE split = 'dataset:arith'").to_pylist()[0]["n"] == 5

    # another file under the same name is refused, nothing lands; under its own name it is evaluated
    (tmp_path / "b").mkdir()
    other = _write(tmp_path / "b" / "arith.jsonl", [{"question": "What is 2 + 2?", "answer": "4"}])
    code, _, err = _cli("eval", "--run-id", "ds", "--dataset", other, "--store", store.root)
    assert code == 1 and "already has results for a different file named 'arith'" in err and err.count("\n") == 1
    assert sql(store, "SELECT count(*) AS n FROM prompts WHERE text = 'What is 2 + 2?'").to_pylist() == [{"n": 0}]
    code, out, err = _cli("eval", "--run-id", "ds", "--dataset", other, "--dataset-name", "twos",
                          "--store", store.root)
    assert code == 0 and "dataset:twos, 1 prompts" in out, err

    # bad input: one line naming the problem, and nothing lands
    before = sql(store, "SELECT count(*) AS n FROM prompts").to_pylist()
    bad = _write(tmp_path / "bad.jsonl", [{"question": "What is 1 + 1?"}, {"question": "x", "answer": "1"}])
    for args, problem in [(["--dataset", bad], "bad.jsonl: rejected, 1 bad row(s), nothing written: bad.jsonl line 1"),
                          (["--dataset", str(tmp_path / "missing.jsonl")], "missing.jsonl: no such file"),
                          (["--dataset", path, "--dataset-name", "../etc"], "dataset name '../etc' is not valid"),
                          (["--dataset", path, "--dataset-name", "n" * 101], "is 101 characters: use at most 100")]:
        code, _, err = _cli("eval", "--run-id", "ds", *args, "--store", store.root)
        assert code == 1 and problem in err and err.count("\n") == 1, err
    assert sql(store, "SELECT count(*) AS n FROM prompts").to_pylist() == before


def test_a_token_budget_stops_the_run_and_a_larger_one_resumes_it(prefect_api, store):
    from flows.curriculum import curriculum

    sets = [*SETS, "eval.enabled=false"]
    out = curriculum(load_config(sets=[*sets, "max_generated_tokens=1"], run_id="b", store=store.root, rounds=3))
    assert {s["round"] for s in out["stages"]} == {0}
    spent = sql(store, "SELECT sum(tokens) AS t FROM generated_tokens WHERE run_id = 'b'").to_pylist()[0]["t"]
    assert out["stopped"] == (f"token budget reached: {spent} generated tokens in rounds 0-0 >= "
                              "max_generated_tokens 1; stopped before round 1")
    (last,) = sql(store, "SELECT status, reason FROM runs WHERE run_id = 'b' ORDER BY created_at DESC LIMIT 1"
                  ).to_pylist()
    assert last == {"status": "completed", "reason": out["stopped"]}
    # a budget half a round past round 0: rounds 0 (landed) and 1 (the budget's last, fitted to about half the
    # batch: tasks/core/budget.py) run, round 2 does not start; spent + 1 would stop before round 1 (one token
    # buys less than half a prompt)
    out = curriculum(load_config(sets=[*sets, f"max_generated_tokens={spent + spent // 2}"], run_id="b",
                                 store=store.root, rounds=3))
    collected = {s["round"] for s in out["stages"] if s.get("stage") == "collect" and "skipped" not in s}
    assert collected == {1} and "stopped before round 2" in out["stopped"]
    assert sql(store, "SELECT DISTINCT round FROM rollouts WHERE run_id = 'b' ORDER BY 1").to_pylist() == [
        {"round": 0}, {"round": 1}]


def test_a_version_evaluated_once_is_reported_in_later_rounds(prefect_api, store, monkeypatch):
    """With training off the policy stays version 0: round 1's evaluate stage reports round 0's numbers instead
    of landing the same version again (a second identical row would count twice in SQL), and still lands, so
    a resume skips it. Sampled again anyway, the version gives the same samples: reporting loses nothing."""
    from flows.curriculum import curriculum

    out = curriculum(load_config(sets=SETS, run_id="same", store=store.root, rounds=2))
    evaluated = [s for s in out["stages"] if s["stage"] == "evaluate"]
    assert [s.get("reported") for s in evaluated] == [None, [0]]
    assert evaluated[1]["versions"] == evaluated[0]["versions"] and evaluated[0]["versions"][0]["pass_at_1"] > 0
    assert sql(store, "SELECT round, policy_version, count(*) AS n FROM evals WHERE run_id = 'same' GROUP BY ALL"
               ).to_pylist() == [{"round": 0, "policy_version": 0, "n": 1}]
    assert sql(store, "SELECT DISTINCT round FROM eval_results WHERE run_id = 'same'").to_pylist() == [{"round": 0}]
    assert store.landed("same", 1, "evaluate")
    assert not any(r["stage"] == "evaluate" and r["round"] == 1 for r in sql(
        store, "SELECT stage, round FROM generated_tokens WHERE run_id = 'same'").to_pylist())  # nothing sampled
    import tasks.evaluate
    from flows.evaluate import evaluate

    monkeypatch.setattr(tasks.evaluate, "landed_heldout", lambda *_: {})
    evaluate(run_id="same", checkpoint=0, store=store.root)  # lands stage eval-v0 beside round 0's evaluate
    per_prompt = sql(store, "SELECT prompt_id, n_correct, n_tokens FROM eval_results WHERE run_id = 'same' "
                            "ORDER BY prompt_id, n_correct, n_tokens").to_pylist()
    assert len(per_prompt) == 2 * evaluated[0]["prompts"]
    assert per_prompt[0::2] == per_prompt[1::2] and any(r["n_correct"] for r in per_prompt)
