"""LoPE (lorem_perturb): prefixes, the rescue of all-fail groups, its records, and the ratio shaping."""

import json

import pytest
from conftest import round_ctx

from models.backend import Completion, Sampling
from tasks.core.lope import LOREM, is_lope_replaced, lope_rescue, lorem_prefixes, shaped_ratio


def test_prefixes_are_distinct_lorem_of_100_to_300_words_and_seeded():
    a = lorem_prefixes(6, seed=3)
    assert a == lorem_prefixes(6, seed=3) and a != lorem_prefixes(6, seed=4)
    assert len(set(a)) == 6
    lengths = [len(p.split()) for p in a]
    assert min(lengths) == 100 and max(lengths) == 300
    assert {w.rstrip(".").lower() for p in a for w in p.split()} <= set(LOREM)  # Lorem words only
    assert all(p[0].isupper() and p.endswith(".") for p in a)
    assert not any(ch.isdigit() for p in a for ch in p)  # a prefix never carries a number into a math prompt


def test_shaped_ratio():
    assert shaped_ratio(1.0) == pytest.approx(1 / 1.1)
    assert shaped_ratio(0.0) == 0.0
    assert shaped_ratio(100.0) < 1.0  # bounded: an off-policy sample cannot blow up the update


def _fail_groups(n_groups: int, g: int):
    groups = [[Completion(f"fail {i}.{j}", [1], [-1.0]) for j in range(g)] for i in range(n_groups)]
    correct = [[False] * g for _ in range(n_groups)]
    return groups, correct


def test_rescue_replaces_up_to_g_minus_1_and_keeps_a_failure(tiny_backend):
    """Real resamples from the tiny model; the verifier here accepts every resample of group 0 and none of
    group 1, so group 0 gets G - 1 replacements (not G) and group 1 none."""
    g = 4
    groups, correct = _fail_groups(3, g)
    correct[2][1] = True  # a mixed group is never resampled
    augs = [[None] * g, [None] * g, [json.dumps({"fewshot_context": ["x"], "p": 0.5})] * g]
    msgs = [[{"role": "user", "content": f"What is {i} + 1?"}] for i in range(3)]
    stats = lope_rescue(tiny_backend, msgs, correct, groups, augs, Sampling(0.7, 1.0, 3, seed=1),
                        lambda i, text: (1.0, True) if i == 0 else (0.0, False), n_prefixes=3, per_prefix=2)
    assert (stats.groups, stats.rescued, stats.replaced, stats.resamples) == (2, 1, g - 1, 2 * 3 * 2)
    assert correct[0] == [False, True, True, True] and correct[1] == [False] * g
    assert groups[0][0].text == "fail 0.0" and all(not c.text.startswith("fail") for c in groups[0][1:])
    replaced = [json.loads(a)["lorem_perturb"] for a in augs[0][1:]]
    assert all(r["replaced"] and 0 <= r["prefix"] < 3 and r["prefix_words"] >= 100 for r in replaced)
    assert [is_lope_replaced(a) for a in augs[0]] == [False, True, True, True]
    kept = json.loads(augs[0][0])["lorem_perturb"]
    assert kept == {"replaced": False, "resampled": 6, "correct": 6}
    assert all(json.loads(a)["lorem_perturb"]["correct"] == 0 for a in augs[1])
    assert augs[2] == [json.dumps({"fewshot_context": ["x"], "p": 0.5})] * g  # untouched


def test_a_replacement_records_the_reward_of_the_own_sample_it_replaced(tiny_backend):
    """Scoring reads the policy's own G samples (tasks/core/eps.py own_samples), so each replacement keeps the
    reward of the failure it displaced, e.g. a format reward: slots are replaced from the end."""
    g = 4
    groups, correct = _fail_groups(1, g)
    augs = [[None] * g]
    own = [[0.0, 0.1, 0.2, 0.3]]
    lope_rescue(tiny_backend, [[{"role": "user", "content": "What is 1 + 1?"}]], correct, groups, augs,
                Sampling(0.7, 1.0, 3, seed=1), lambda i, text: (1.0, True), n_prefixes=2, per_prefix=2,
                own_rewards=own)
    records = [json.loads(a)["lorem_perturb"] for a in augs[0]]
    assert [r.get("own_reward") for r in records] == [None, 0.1, 0.2, 0.3]
    assert [r["replaced"] for r in records] == [False, True, True, True]
    assert own == [[0.0, 0.1, 0.2, 0.3]]  # read, not rewritten


def test_rescue_is_seeded_and_respects_the_group_cap(tiny_backend):
    def run():
        groups, correct = _fail_groups(3, 2)
        augs = [[None] * 2 for _ in range(3)]
        msgs = [[{"role": "user", "content": f"q{i}"}] for i in range(3)]
        stats = lope_rescue(tiny_backend, msgs, correct, groups, augs, Sampling(0.7, 1.0, 3, seed=5),
                            lambda i, text: (1.0, True) if len(text) % 2 == 0 else (0.0, False),
                            n_prefixes=2, per_prefix=2, max_groups=2)
        return stats, [[c.text for c in g] for g in groups], augs

    a, b = run(), run()
    assert a[1:] == b[1:]
    assert a[0].groups == 2 and a[2][2] == [None, None]  # the third all-fail group is past the cap


def test_collect_resamples_all_fail_groups(store):
    """The tiny model never answers right, so every group is all-fail: LoPE resamples the first
    lope_max_groups of them, records the attempt on each rollout, and replaces nothing."""
    from test_curriculum import TINY

    from flows.config import load_config
    from storage.query import sql
    from tasks.collect import collect_task
    from tasks.pool import pool_task

    cfg = load_config(sets=[*TINY, "rollout.lope_max_groups=3", "rollout.lope_prefixes=2", "rollout.lope_samples=2"])
    pool_task.fn(round_ctx(store, "l", 0), cfg.pool)
    out = collect_task.fn(round_ctx(store, "l", 0, model=cfg.model), cfg.rollout, cfg.reward, cfg.select)
    assert {k: v for k, v in out["lope"].items() if k != "seconds"} == {"groups": 3, "rescued": 0, "replaced": 0,
                                                                         "resamples": 3 * 2 * 2}
    rows = sql(store, """SELECT count(DISTINCT prompt_id) AS groups, count(*) AS n,
                                max(json_extract(augmentation, '$.lorem_perturb.resampled')::INT) AS resampled
                         FROM rollouts WHERE augmentation LIKE '%lorem_perturb%'""").to_pylist()[0]
    assert rows == {"groups": 3, "n": 3 * 4, "resampled": 4}
    off = load_config(sets=[*TINY, "rollout.lope_prefixes=0"])
    pool_task.fn(round_ctx(store, "off", 0), off.pool)
    out = collect_task.fn(round_ctx(store, "off", 0, model=off.model), off.rollout, off.reward, off.select)
    assert out["lope"]["groups"] == 0
    assert sql(store, "SELECT count(*) AS n FROM rollouts WHERE run_id = 'off' AND augmentation IS NOT NULL"
               ).to_pylist() == [{"n": 0}]
