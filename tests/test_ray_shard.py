"""Rollouts sharded over a local Ray cluster (models/sharded.py): the same rows as one process.

A two-round curriculum run on the tiny random model (LoPE on, so its resamples are sharded too), its held-out
evaluations and a rescore of its reserve pool run twice on two stores: once in this process, once with
`scale.rollout_workers = 2` on a Ray instance this test starts on 127.0.0.1. Keyed sampling
(tasks/core/seeds.py row_seeds) makes every row a function of its own key, so the row hashes of `rollouts`,
`eval_results` and `evals` must be equal. Both sides compute with one thread (Ray's workers get one CPU
each), so floating-point reductions add up in the same order.
"""

import hashlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_curriculum import TINY  # noqa: E402

from flows.config import load_config  # noqa: E402
from storage.query import sql  # noqa: E402
from storage.store import Store  # noqa: E402

pytest.importorskip("ray")

HASHED = {  # the columns that say what was generated and how it scored (not when or where)
    "rollouts": "round, policy_version, prompt_id, sample_idx, prompt_text, completion, reward, correct, n_tokens, "
                "finish_reason, augmentation, round(mean_logprob, 4) AS lp",
    "eval_results": "round, policy_version, split, prompt_id, n_samples, n_correct, n_tokens",
    "evals": "round, policy_version, split, n_prompts, pass_at_1, pass_at_k",
}


def _hashes(store: Store, table: str) -> list[str]:
    rows = sql(store, f"SELECT {HASHED[table]} FROM {table} ORDER BY ALL").to_pylist()
    return [hashlib.sha256(repr(sorted(r.items())).encode()).hexdigest()[:16] for r in rows]


def _run(root: Path, sets: list[str]) -> Store:
    from flows.curriculum import curriculum
    from flows.rescore import rescore

    curriculum(load_config(sets=[*TINY, "rollout.lope_max_groups=4", *sets], run_id="shard", store=str(root),
                           rounds=2))
    rescore(run_id="shard", store=str(root))
    return Store(root)


@pytest.mark.slow
def test_sharded_stages_write_the_single_process_rows(prefect_api, tmp_path):
    import torch

    from models import sharded

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = _run(tmp_path / "one", [])
        two = _run(tmp_path / "two", ["scale.rollout_workers=2", "scale.ray_address=local"])
        import os

        import ray

        assert len(sharded._ACTORS) == 1  # one set of actors served every stage and round
        stats = ray.get([w.stats.remote() for w in next(iter(sharded._ACTORS.values()))])
        assert len({pid for pid, _ in stats} - {os.getpid()}) == 2 and all(n > 0 for _, n in stats), stats
    finally:
        torch.set_num_threads(threads)
        sharded.shutdown()
    for table in HASHED:
        a, b = _hashes(one, table), _hashes(two, table)
        assert a and a == b, f"{table}: {len(set(a) ^ set(b))} rows differ"
    rescored = sql(two, "SELECT count(*) AS n FROM rollouts WHERE augmentation LIKE '%\"rescore\"%'").to_pylist()
    lope = sql(two, "SELECT count(*) AS n FROM rollouts WHERE augmentation LIKE '%lorem%'").to_pylist()
    assert rescored[0]["n"] > 0 and lope[0]["n"] > 0  # the sharded paths were exercised, not skipped


def test_sharding_splits_evenly_and_refuses_unkeyed_calls(tiny_backend):
    from models.backend import Sampling
    from models.sharded import ShardedBackend, shards

    assert [len(r) for r in shards(10, 3)] == [4, 3, 3]
    assert [i for r in shards(7, 4) for i in r] == list(range(7))
    b = object.__new__(ShardedBackend)  # no Ray needed to refuse: the check comes before any call
    b.local, b.workers = tiny_backend, [None, None]
    with pytest.raises(ValueError, match="needs one row seed per prompt"):
        b.generate(["a", "b"], 2, Sampling())
    with pytest.raises(ValueError, match="needs one row seed per prompt"):
        b.generate(["a", "b"], 2, Sampling(), row_seeds=[1])


def test_scale_config_refuses_bad_addresses():
    from pydantic import ValidationError

    for bad in ["rollout_workers=0", "ray_address=http://x", "ray_address=local; rm -rf /", "cpus_per_worker=0"]:
        with pytest.raises((ValidationError, ValueError)):
            load_config(sets=[f"scale.{bad}"])
    assert load_config(sets=["scale.ray_address=ray://head.example:10001"]).scale.ray_address.startswith("ray://")
    with pytest.raises((ValidationError, ValueError), match="gpus_per_worker is 0"):
        load_config(sets=["scale.rollout_workers=2", "model.device=cuda"])
