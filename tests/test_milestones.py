"""Evaluation at generated-token milestones (tasks/evaluate.py, flows/curriculum.py `evaluation`): on the scripted
policy, a run evaluates exactly where its generated tokens (evaluation excluded) first reach a multiple of
eval.milestone_tokens, and at its end; greedy decoding takes one sample per prompt; a run killed between a
milestone's training and its evaluation evaluates it on resume; a comparison's evaluation share is evaluation
tokens over all its generated tokens."""

import pytest
from conftest import q

import flows.curriculum as curriculum_module
from flows.config import load_config, stored_base
from storage.store import Store
from tasks.compare.figures import eval_token_share, frame, run_curves
from tasks.evaluate import EvalConfig, due, milestone_reached

SETS = ["model.policy=tiny-random", "model.backend=scripted", "model.dtype=fp32",
        "rollout.group_size=4", "rollout.max_new_tokens=40", "select.embedder=hashing", "select.batch_size=6",
        "refine.strategies=[]", "shape.enabled=false", "governor.enabled=false", "train.lr=1e-3",
        'pool.sources=[{"source": "rg:products", "size": 10, "params": {"max_digits": 1}}, '
        '{"source": "rg:chain_sum", "size": 10, "params": {"min_terms": 2, "max_terms": 2, "max_digits": 1}}]']
ROUNDS = 4
EVERY = 1000  # about two scripted rounds of 6 prompts x 4 samples (~460 tokens each)


def _tokens_by_round(store, run: str) -> list[int]:
    rows = q(store, f"""SELECT round, sum(tokens) AS t FROM generated_tokens
                        WHERE run_id = '{run}' AND purpose <> 'eval' GROUP BY round ORDER BY round""")
    return [int(r["t"]) for r in rows]


def _expected(per_round: list[int], every: int) -> dict[int, tuple[int, int | None, int]]:
    """round -> (version, milestone, tokens before the checkpoint), worked out here from the rounds' tokens."""
    out, total = {0: (0, 0, 0)}, 0
    for r, t in enumerate(per_round):
        before, total = total, total + t
        crossed = [m for m in range(every, total + 1, every) if m > before]
        if crossed or r == len(per_round) - 1:
            out[r + 1] = (r + 1, crossed[-1] if crossed else None, total)
    return out


def _evals(store, run: str) -> dict[int, tuple]:
    rows = q(store, f"""SELECT round, policy_version, milestone, generated_tokens, k FROM evals
                        WHERE run_id = '{run}' AND split = 'heldout' ORDER BY policy_version""")
    return {r["policy_version"]: r for r in rows}


def _check_run(store, run: str) -> None:
    per_round = _tokens_by_round(store, run)
    assert len(per_round) == ROUNDS
    want = _expected(per_round, EVERY)
    got = _evals(store, run)
    assert sorted(got) == sorted(want), (per_round, sorted(got), sorted(want))
    assert 1 < len(got) < ROUNDS + 1, f"the milestone skipped no round or every one: {per_round}"
    for v, (_, mark, tokens) in want.items():
        row = got[v]
        assert (row["milestone"], row["generated_tokens"], row["k"]) == (mark, tokens, 1), row
        assert row["round"] == max(v - 1, 0)  # evaluated in the round that trained it
    # greedy: one sample per held-out prompt, pass@1 is correct or not
    samples = q(store, f"SELECT DISTINCT n_samples FROM eval_results WHERE run_id = '{run}'")
    assert samples == [{"n_samples": 1}]


def test_the_run_evaluates_exactly_at_the_milestone_crossings_greedily(prefect_api, tmp_path):
    store = Store(tmp_path / "store")
    cfg = load_config(sets=[*SETS, f"eval.milestone_tokens={EVERY}"], run_id="ms-a", store=store.root,
                      rounds=ROUNDS)
    assert cfg.eval.decoding == "greedy"  # the default
    curriculum_module.curriculum(cfg)
    _check_run(store, "ms-a")
    # the evaluation share the comparison reports: eval tokens over every generated token of its runs
    tokens = frame(store, "TOKENS", "ms")
    total = q(store, "SELECT sum(tokens) AS t FROM generated_tokens")[0]["t"]
    ev = q(store, "SELECT sum(tokens) AS t FROM generated_tokens WHERE purpose = 'eval'")[0]["t"]
    assert ev > 0 and eval_token_share(tokens) == pytest.approx(float(ev) / float(total))
    # one greedy sample per prompt per evaluated checkpoint: eval tokens are completions of those prompts only
    comps = q(store, "SELECT sum(completions) AS c FROM generated_tokens WHERE purpose = 'eval'")[0]["c"]
    prompts = q(store, "SELECT count(*) AS n FROM eval_results")[0]["n"]
    assert comps == prompts
    # the comparison's curve places each checkpoint at its milestone (the run's last at its own tokens)
    curve = run_curves(store, "ms", ["ms-a"])["ms-a"]
    want = _expected(_tokens_by_round(store, "ms-a"), EVERY)
    assert curve.costs["tokens"] == [float(t if m is None else m) for _, m, t in sorted(want.values())]
    assert curve.last_milestone() == max(m for _, m, _ in want.values() if m is not None)


def test_a_run_killed_before_a_milestones_evaluation_evaluates_it_on_resume(prefect_api, tmp_path, monkeypatch):
    store = Store(tmp_path / "store")
    cfg = load_config(sets=[*SETS, f"eval.milestone_tokens={EVERY}"], run_id="ms-b", store=store.root,
                      rounds=ROUNDS)
    real, killed = curriculum_module.evaluate_task, []

    def dies_after_round_0(ctx, *args):
        if ctx.round > 0 and not killed:  # the first milestone after the base model: its checkpoint has landed
            killed.append(ctx.round)
            raise RuntimeError("killed")
        return real(ctx, *args)

    monkeypatch.setattr(curriculum_module, "evaluate_task", dies_after_round_0)
    with pytest.raises(RuntimeError, match="killed"):
        curriculum_module.curriculum(cfg)
    monkeypatch.undo()
    r = killed[0]
    assert q(store, f"SELECT count(*) AS n FROM checkpoints WHERE run_id = 'ms-b' AND policy_version = {r + 1}") \
        == [{"n": 1}]
    assert r + 1 not in _evals(store, "ms-b")
    curriculum_module.curriculum(cfg)  # resume
    _check_run(store, "ms-b")
    assert _evals(store, "ms-b")[r + 1]["round"] == r


def test_every_round_and_sampled_keep_the_old_rows(prefect_api, tmp_path):
    """milestone_tokens 0 and decoding 'sampled' evaluate every round with n samples, milestone columns null."""
    store = Store(tmp_path / "store")
    curriculum_module.curriculum(load_config(sets=[*SETS, "eval.decoding=sampled", "eval.n_samples=3",
                                                   "eval.k=2"], run_id="ms-c", store=store.root, rounds=2))
    rows = q(store, "SELECT policy_version, k, milestone, generated_tokens FROM evals ORDER BY policy_version")
    assert rows == [{"policy_version": v, "k": 2, "milestone": None, "generated_tokens": None} for v in range(3)]
    assert q(store, "SELECT DISTINCT n_samples FROM eval_results") == [{"n_samples": 3}]


def test_milestone_arithmetic_and_old_configs():
    assert milestone_reached(0, 999, 1000) is None and milestone_reached(999, 1000, 1000) == 1000
    assert milestone_reached(1000, 1500, 1000) is None  # reached in an earlier round
    assert due(EvalConfig(milestone_tokens=1000), 1000, 1500, last=True) == (True, None)
    assert due(EvalConfig(milestone_tokens=1000), 1000, 1500, last=False) == (False, None)
    assert due(EvalConfig(), 1000, 1500, last=False) == (True, None)  # 0: every round
    # a run stored before these fields ran sampled, every round: resuming it keeps that
    tree, _ = stored_base({"eval": {"n_samples": 8, "k": 4}})
    assert {k: tree["eval"][k] for k in ("decoding", "milestone_tokens", "n_samples", "k")} == \
        {"decoding": "sampled", "milestone_tokens": 0, "n_samples": 8, "k": 4}
    assert load_config(stored={"eval": {"n_samples": 8, "k": 4}}).eval.decoding == "sampled"
    assert load_config().eval.decoding == "greedy"
    assert load_config().eval.plan() == (1, 1, 0.0)  # greedy: one sample at T = 0, k = 1


def test_a_second_run_reuses_the_base_models_greedy_evaluation_and_spends_nothing_on_it(prefect_api, tmp_path):
    """Two arms in one store share the base model's greedy held-out evaluation (storage/evals.py): the second
    copies the first's rows, records where from, and its generated_tokens count only what it generated; with
    eval.reuse_base off a third run generates the same rows itself (greedy draws nothing)."""
    store = Store(tmp_path / "store")
    runs = {"ru-a": [], "ru-b": ["rollout.seed=1"], "ru-c": ["rollout.seed=2", "eval.reuse_base=false"]}
    for run, extra in runs.items():
        curriculum_module.curriculum(load_config(sets=[*SETS, *extra], run_id=run, store=store.root, rounds=1))
    base = {r["run_id"]: r for r in q(store, "SELECT run_id, plan_key, reused_from, pass_at_1 FROM evals "
                                             "WHERE policy_version = 0 AND split = 'heldout'")}
    assert base["ru-a"]["reused_from"] is None and base["ru-c"]["reused_from"] is None
    assert base["ru-b"]["reused_from"] == "ru-a"
    assert base["ru-a"]["plan_key"] == base["ru-b"]["plan_key"] == base["ru-c"]["plan_key"] is not None
    rows = {run: q(store, f"""SELECT prompt_id, n_samples, n_correct, n_tokens FROM eval_results
                              WHERE run_id = '{run}' AND policy_version = 0 ORDER BY prompt_id""") for run in runs}
    assert rows["ru-a"] == rows["ru-b"] == rows["ru-c"] and len(rows["ru-a"]) > 0
    spent = {run: q(store, f"""SELECT (SELECT sum(tokens) FROM generated_tokens WHERE run_id = '{run}'
                                       AND purpose = 'eval') AS metered,
                                      (SELECT sum(n_tokens) FROM eval_results WHERE run_id = '{run}'
                                       AND policy_version > 0) AS trained""")[0] for run in runs}
    base_tokens = sum(r["n_tokens"] for r in rows["ru-a"])
    assert spent["ru-b"]["metered"] == spent["ru-b"]["trained"]  # the copied evaluation cost ru-b nothing
    assert spent["ru-a"]["metered"] == spent["ru-a"]["trained"] + base_tokens
    assert spent["ru-c"]["metered"] == spent["ru-c"]["trained"] + base_tokens
    assert stored_base({"eval": {}})[0]["eval"]["reuse_base"] is False  # a stored config without the field: off
