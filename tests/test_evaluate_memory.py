"""Evaluation keeps loaded only the version the next round samples.

Round 0 evaluates the base model and the new checkpoint. Before, both backends stayed in the registry (its
cap is two), so round 1's collect ran beside a base model nobody sampled: about 1 GiB on the default model
(fp32 weights and their packed copies; `git show 7f3fe64:docs/performance.md`).
"""

import shutil

from conftest import land_pool, prompt_rows, round_ctx

from flows.config import EvalConfig, ModelConfig, RewardConfig, RolloutConfig
from models.registry import load_model, loaded_policies, release_backends, resolve


def test_round_zero_evaluation_frees_the_base_and_keeps_the_new_checkpoint(store, tmp_path):
    from tasks.evaluate import evaluate_versions

    rows = prompt_rows(3)
    store.commit("ingest-t", {"prompts": rows})
    land_pool(store, "e", 0, rows["prompt_id"].to_pylist(), status="heldout")
    v1 = shutil.copytree(resolve("tiny-random"), tmp_path / "v1")  # the round's new checkpoint, as a folder
    model = ModelConfig(policy="tiny-random", backend="scripted", dtype="fp32", batch_size=8)
    release_backends()
    load_model(model)  # the round's policy, loaded by collect
    ctx = round_ctx(store, "e", 0, model=model)
    out = evaluate_versions(store, ctx, [(0, "tiny-random"), (1, str(v1))], EvalConfig(n_samples=2, k=1),
                            RolloutConfig(max_new_tokens=16), RewardConfig())
    assert sorted(out["versions"]) == [0, 1]
    assert loaded_policies() == [str(v1)]
    release_backends()


def test_evaluating_one_version_keeps_it_loaded(store):
    from tasks.evaluate import evaluate_versions

    rows = prompt_rows(2)
    store.commit("ingest-t", {"prompts": rows})
    land_pool(store, "e", 0, rows["prompt_id"].to_pylist(), status="heldout")
    model = ModelConfig(policy="tiny-random", backend="scripted", dtype="fp32", batch_size=8)
    release_backends()
    evaluate_versions(store, round_ctx(store, "e", 1, model=model), [(1, "tiny-random")],
                      EvalConfig(n_samples=2, k=1), RolloutConfig(max_new_tokens=16), RewardConfig())
    assert loaded_policies() == ["tiny-random"]
    release_backends()
