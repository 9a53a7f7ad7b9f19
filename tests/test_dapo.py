"""DAPO dynamic sampling (the `dapo_filter` baseline): over-sample within the round, drop groups whose rewards
are all equal, refill until the batch holds B groups, stop at the cap on generation batches; the discarded
rollouts land in `discarded_rollouts`, queryable in SQL, and never enter scoring, training or the pool.

The pure loop is tested on made-up groups; the stage and the flow on the scripted policy (models/scripted.py),
whose prompts have every solve rate, so some groups are all wrong, some all right and some mixed."""

import io
from contextlib import redirect_stdout

import pytest
from conftest import q, round_ctx

from flows.config import load_config
from storage.store import Store
from tasks.core.dapo import dynamic_sampling, first_batch_size, has_variance, refill_size


# ---- the pure loop ------------------------------------------------------------------------------------------
def _generator(rewards: dict[int, list[float]]):
    """generate(items, k) for dynamic_sampling that records each call's items."""
    calls: list[list[int]] = []

    def generate(items: list[int], k: int) -> list[list[float]]:
        assert k == len(calls)
        calls.append(list(items))
        return [rewards[i] for i in items]

    return generate, calls


MIXED, WRONG, RIGHT = [0.0, 1.0, 0.0, 1.0], [0.0] * 4, [1.0] * 4


def test_zero_variance_groups_are_dropped_and_refilled_until_full():
    rewards = {i: (WRONG if i % 3 == 0 else MIXED) for i in range(20)}  # 0, 3, 6, ... are all wrong
    gen, calls = _generator(rewards)
    out = dynamic_sampling(list(range(20)), batch=5, oversample=1.0, max_batches=10, generate=gen,
                           rewards=lambda g: g)
    # batch 1: 0..4 keeps 1, 2, 4; refill ceil(1.0 * 2) = 2: 5, 6 keeps 5; refill 1: 7 keeps it
    assert calls == [[0, 1, 2, 3, 4], [5, 6], [7]]
    assert [d.item for d in out.kept] == [1, 2, 4, 5, 7] and all(d.varied for d in out.kept)
    assert [(d.item, d.gen_batch, d.reason) for d in out.discarded] == [(0, 0, "zero_variance"),
                                                                         (3, 0, "zero_variance"),
                                                                         (6, 1, "zero_variance")]
    assert (out.batches, out.generated, out.short, out.cap_hit, out.exhausted) == (3, 8, 0, False, False)


def test_overflow_keeps_every_varied_group_of_the_batch_that_reaches_b():
    """Screening decides itself which groups it completes: with overflow, the batch that reaches B keeps all its
    varied groups (none is surplus), and no further batch runs; without it, the ones past B are surplus."""
    rewards = {i: MIXED for i in range(8)}
    for overflow, kept, surplus in ((True, 6, 0), (False, 4, 2)):
        gen, calls = _generator(rewards)
        out = dynamic_sampling(list(range(8)), batch=4, oversample=1.0, max_batches=10, generate=gen,
                               rewards=lambda g: g, first_size=6, overflow=overflow)
        assert calls == [[0, 1, 2, 3, 4, 5]] and len(out.kept) == kept and out.short == 0
        assert [d.reason for d in out.discarded] == ["surplus"] * surplus


def test_refill_is_the_missing_groups_times_the_oversampling_factor():
    assert first_batch_size(48, 3.0) == 144 and first_batch_size(5, 1.5) == 8 and first_batch_size(10, 1.1) == 11
    assert refill_size(48, 40, 3.0) == 24 and refill_size(5, 4, 1.5) == 2
    rewards = {i: (RIGHT if i < 6 else MIXED) for i in range(40)}  # the first 6 are saturated
    gen, calls = _generator(rewards)
    out = dynamic_sampling(list(range(40)), batch=4, oversample=1.5, max_batches=10, generate=gen, rewards=lambda g: g)
    assert [len(c) for c in calls] == [6, 6]  # 6 saturated; then ceil(1.5 * 4) = 6 more, 4 kept, 2 surplus
    assert [d.item for d in out.kept] == [6, 7, 8, 9]
    assert [(d.item, d.reason) for d in out.discarded][-2:] == [(10, "surplus"), (11, "surplus")]
    assert out.short == 0 and out.generated == 12


def test_the_cap_on_generation_batches_is_honoured_and_the_short_batch_reported():
    rewards = {i: (MIXED if i % 4 == 0 else WRONG) for i in range(100)}  # one group in four is mixed
    gen, calls = _generator(rewards)
    out = dynamic_sampling(list(range(100)), batch=8, oversample=1.0, max_batches=3, generate=gen, rewards=lambda g: g)
    assert len(calls) == 3 and out.batches == 3
    assert len(out.kept) < 8 and out.short == 8 - len(out.kept) and out.cap_hit and not out.exhausted
    assert out.generated == sum(map(len, calls)) == len(out.kept) + len(out.discarded)


def test_running_out_of_candidates_is_not_a_cap_hit():
    gen, calls = _generator({i: WRONG for i in range(5)})
    out = dynamic_sampling(list(range(5)), batch=3, oversample=1.0, max_batches=10, generate=gen, rewards=lambda g: g)
    assert calls == [[0, 1, 2], [3, 4]] and out.kept == [] and out.short == 3
    assert out.exhausted and not out.cap_hit


def test_first_batch_size_can_be_given():
    """The select stage already drew the first generation batch; the loop takes its size as given."""
    gen, calls = _generator({i: MIXED for i in range(10)})
    out = dynamic_sampling(list(range(10)), batch=4, oversample=3.0, max_batches=2, generate=gen,
                           rewards=lambda g: g, first_size=5)
    assert calls == [[0, 1, 2, 3, 4]] and len(out.kept) == 4 and [d.reason for d in out.discarded] == ["surplus"]


def test_variance_means_the_rewards_differ():
    assert not has_variance([1.0, 1.0, 1.0]) and not has_variance([0.0, 0.0]) and not has_variance([0.5] * 4)
    assert not has_variance([0.1, 0.1 + 1e-9]) and has_variance([0.0, 1.0]) and has_variance([0.1, 0.1, 0.2])
    assert not has_variance([1.0])  # one sample: no advantage to learn from


@pytest.mark.parametrize("kw,message", [
    ({"batch": 0}, "batch size must be >= 1, got 0"),
    ({"oversample": 0.5}, "over-sampling factor must be >= 1, got 0.5"),
    ({"max_batches": 0}, "generation batches must be >= 1, got 0"),
    ({"first_size": 0}, "first generation batch must hold >= 1 prompt, got 0"),
])
def test_bad_arguments_are_named(kw, message):
    args = {"batch": 2, "oversample": 1.0, "max_batches": 1, **kw}
    with pytest.raises(ValueError, match=message):
        dynamic_sampling([1, 2], generate=lambda items, k: [MIXED] * len(items), rewards=lambda g: g, **args)


def test_generate_must_answer_each_item():
    with pytest.raises(ValueError, match="generation batch 1 returned 1 groups for 2 prompts"):
        dynamic_sampling([1, 2], batch=2, oversample=1.0, max_batches=1, generate=lambda items, k: [MIXED],
                         rewards=lambda g: g)


# ---- the stages, on the scripted policy ---------------------------------------------------------------------
def scripted_dapo(*extra: str) -> list[str]:
    return ["model.policy=tiny-random", "model.backend=scripted", "model.dtype=fp32", "rollout.group_size=4",
            "rollout.max_new_tokens=40", "rollout.fewshot_k=0", "rollout.lope_prefixes=0",
            "select.selector=dapo_filter", "select.batch_size=6", "select.dapo_oversample=1.0",
            "select.embedder=hashing",
            'pool.sources=[{"source": "rg:products", "size": 40, "params": {"max_digits": 1}}]', *extra]


def _select_and_collect(store: Store, run: str, sets: list[str]) -> dict:
    from tasks.collect import collect_task
    from tasks.pool import pool_task
    from tasks.select import select_task

    cfg = load_config(sets=sets)
    pool_task.fn(round_ctx(store, run, 0), cfg.pool)
    select_task.fn(round_ctx(store, run, 0, model=cfg.model), cfg.select, cfg.rollout.include_reserve)
    return collect_task.fn(round_ctx(store, run, 0, model=cfg.model), cfg.rollout, cfg.reward, cfg.select,
                           use_selection=True)



def test_collect_refills_to_b_mixed_groups_and_stores_the_discards(store):
    out = _select_and_collect(store, "d", scripted_dapo())
    d = out["dapo"]
    assert d["generation_batches"] >= 2 and d["kept"] == 6 and d["short"] == 0  # a refill happened
    kept = q(store, """SELECT prompt_id, count(*) AS n, min(reward) AS lo, max(reward) AS hi, sum(n_tokens) AS tokens
                       FROM rollouts WHERE run_id = 'd' GROUP BY prompt_id""")
    assert len(kept) == 6 and all(g["n"] == 4 and g["lo"] < g["hi"] for g in kept)
    # the discards, in SQL: per round, rollouts and the generated tokens to charge to the baseline's budget
    spent = q(store, """SELECT round, count(*) AS n, count(DISTINCT prompt_id) AS groups, sum(n_tokens) AS tokens
                        FROM discarded_rollouts WHERE run_id = 'd' GROUP BY round""")
    assert spent == [{"round": 0, "n": 4 * d["discarded_groups"], "groups": d["discarded_groups"],
                      "tokens": d["discarded_tokens"]}]
    assert d["discarded_groups"] > 0 and d["discarded_tokens"] > 0
    assert out["tokens"] == d["discarded_tokens"] + sum(g["tokens"] for g in kept)  # spent = kept + discarded
    groups = q(store, """SELECT prompt_id, reason, gen_batch, min(reward) AS lo, max(reward) AS hi, count(*) AS n
                         FROM discarded_rollouts WHERE run_id = 'd' GROUP BY ALL""")
    for g in groups:  # a refill was needed because of these: every discard has zero variance (no surplus here)
        assert g["reason"] == "zero_variance" and g["lo"] == g["hi"] and g["n"] == 4, g
    # selections hold every prompt generated for: each one's group is kept or discarded, never both
    selected = [r["prompt_id"] for r in q(store, "SELECT prompt_id FROM selections WHERE run_id = 'd'")]
    assert len(selected) == len(set(selected)) == d["groups_generated"] == 6 + len(groups)
    assert set(selected) == {g["prompt_id"] for g in kept} | {g["prompt_id"] for g in groups}
    assert not {g["prompt_id"] for g in kept} & {g["prompt_id"] for g in groups}


def test_discards_get_no_score_and_stay_in_the_pool(store):
    """The score stage scores the kept groups only; a discarded prompt keeps its pool status (DAPO draws from
    the whole dataset again next time) instead of moving to reserve as a scored saturated/too_hard one would."""
    from tasks.pool import PoolConfig, pool_task
    from tasks.score import UtilityConfig, score_task

    out = _select_and_collect(store, "s", scripted_dapo())
    score_task.fn(round_ctx(store, "s", 0), UtilityConfig())
    scored = q(store, "SELECT prompt_id, bucket FROM prompt_scores WHERE run_id = 's'")
    assert len(scored) == out["dapo"]["kept"] and {s["bucket"] for s in scored} == {"informative"}
    pool_task.fn(round_ctx(store, "s", 1), PoolConfig())
    after = q(store, """SELECT DISTINCT p.status FROM pool p JOIN discarded_rollouts d USING (run_id, prompt_id)
                        WHERE p.run_id = 's' AND p.round = 1""")
    assert after == [{"status": "active"}]


def test_the_cap_leaves_the_batch_short_and_says_so(store):
    out = _select_and_collect(store, "c", scripted_dapo("select.dapo_max_batches=1"))
    d = out["dapo"]
    assert d["generation_batches"] == 1 and d["groups_generated"] == 6  # ceil(1.0 * 6), no refill
    assert d["kept"] < 6 and d["short"] == 6 - d["kept"] and d["cap_hit"]
    n = q(store, "SELECT count(DISTINCT prompt_id) AS n FROM rollouts WHERE run_id = 'c'")[0]["n"]
    assert n == d["kept"] == out["prompts"]
    from tasks.reporting.summary import short_batch as _short_batch

    assert _short_batch(d) == f"; the batch is SHORT by {d['short']} groups (the cap of 1 generation batch was hit)"


def test_when_no_group_varies_nothing_is_kept_and_every_group_is_charged(store, tmp_path):
    """Questions the scripted policy can never solve: every group is all wrong, the candidates run out, the
    round keeps no rollout (the train stage then has nothing to do) and discards all of them."""
    import json

    src = tmp_path / "never.jsonl"
    src.write_text("".join(json.dumps({"question": f"Name the number {w}.", "answer": str(i)}) + "\n"
                           for i, w in enumerate(["one", "two", "three", "four", "five"])))
    out = _select_and_collect(store, "e", scripted_dapo(f'pool.sources=[{{"source": "{src}"}}]'))
    d = out["dapo"]
    assert (d["kept"], d["short"], d["exhausted"], d["cap_hit"], d["zero_variance"]) == (0, 6, True, False, 5)
    assert q(store, "SELECT count(*) AS n FROM rollouts WHERE run_id = 'e'") == [{"n": 0}]
    assert q(store, """SELECT count(*) AS n, sum(n_tokens) AS tokens FROM discarded_rollouts
                       WHERE run_id = 'e'""") == [{"n": 20, "tokens": out["tokens"]}]


def test_a_short_dapo_filter_run_shows_its_discards_in_sql(prefect_api, tmp_path):
    """Two rounds of the curriculum flow with dapo_filter on the scripted policy: each round's discarded
    rollouts are in SQL with their tokens, training sees only the kept mixed groups, and the run summary
    names what was discarded."""
    from flows.cli import print_summary
    from flows.curriculum import curriculum

    store = Store(tmp_path / "store")
    cfg = load_config(sets=scripted_dapo("refine.strategies=[]", "shape.enabled=false", "eval.enabled=false",
                                         "select.dapo_oversample=1.5", "train.kl_coef=0",
                                         "train.micro_batch=24"),
                      run_id="dapo", store=store.root, rounds=2)
    out = curriculum(cfg)
    spent = q(store, """SELECT round, count(DISTINCT prompt_id) AS groups, count(*) AS rollouts,
                               sum(n_tokens) AS tokens FROM discarded_rollouts WHERE run_id = 'dapo'
                        GROUP BY round ORDER BY round""")
    collected = {s["round"]: s["dapo"] for s in out["stages"] if s["stage"] == "collect"}
    assert [r["round"] for r in spent] == [0, 1]
    for r in spent:
        d = collected[r["round"]]
        assert r["groups"] == d["discarded_groups"] > 0 and r["tokens"] == d["discarded_tokens"] > 0
    trained = {s["round"]: s for s in out["stages"] if s["stage"] == "train"}
    for r in (0, 1):
        assert trained[r]["zero_variance_groups"] == 0 and trained[r]["groups"] == collected[r]["kept"] == 6
    with redirect_stdout(io.StringIO()) as printed:
        print_summary(out)
    lines = [x for x in printed.getvalue().splitlines() if "dapo_filter kept" in x]
    assert [x.split(":")[0] for x in lines] == ["round 0", "round 1"], lines
    for x, r in zip(lines, spent):
        assert f"({r['rollouts']} rollouts, {r['tokens']} tokens; see discarded_rollouts)" in x, x
