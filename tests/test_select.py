import numpy as np
import polars as pl
import pytest
from conftest import round_ctx

from tasks.core.selection import (
    allocate,
    cluster_entropy,
    cluster_utility,
    n_clusters,
    select_dapo_filter,
    select_kmeans,
    select_uniform,
    softmax_weights,
)


def test_cluster_count_rule():
    assert [n_clusters(n) for n in (1, 8, 9, 100, 10_000)] == [1, 1, 2, 13, 64]
    assert n_clusters(10_000, k_max=16) == 16


def test_softmax_weights_follow_utility_and_temperature():
    u = np.array([0.4, 0.2, 0.0, -np.inf])  # -inf: an empty cluster gets no weight
    w = softmax_weights(u, 0.1)
    assert w.sum() == pytest.approx(1.0) and w[3] == 0.0
    assert w[0] / w[1] == pytest.approx(np.exp(2.0))
    assert np.allclose(softmax_weights(np.array([0.4, 0.2]), 1e6), [0.5, 0.5])


def test_unscored_members_get_the_scored_mean_plus_bonus():
    labels = np.array([0, 0, 1, 1])
    eps = np.array([0.2, 0.4, np.nan, np.nan])
    u = cluster_utility(labels, eps, k=3, bonus=0.05)
    assert u[0] == pytest.approx(0.3) and u[1] == pytest.approx(0.35) and u[2] == -np.inf


@pytest.mark.parametrize("batch,w,sizes,expected", [
    (10, [0.5, 0.3, 0.2], [100, 100, 100], [5, 3, 2]),
    (7, [0.5, 0.3, 0.2], [100, 100, 100], [4, 2, 1]),   # remainders .5, .1, .4: the largest gets the spare
    (10, [0.8, 0.1, 0.1], [2, 100, 100], [2, 4, 4]),    # a capped cluster's excess is re-split
    (50, [0.6, 0.4], [10, 20], [10, 20]),               # more than the pool: everyone
    (3, [1.0, 0.0, 0.0], [1, 5, 5], [1, 1, 1]),         # zero-weight clusters still absorb overflow
])
def test_largest_remainder_allocation_with_caps(batch, w, sizes, expected):
    got = allocate(batch, np.array(w), np.array(sizes))
    assert got.tolist() == expected
    assert (got <= np.array(sizes)).all() and got.sum() == min(batch, sum(sizes))


def _pool(seed=0, clusters=8, per=50, dim=16):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(clusters, dim)) * 5
    x = np.concatenate([c + rng.normal(size=(per, dim)) for c in centers]).astype(np.float32)
    truth = np.repeat(np.arange(clusters), per)
    eps = np.where(truth % 2 == 0, 0.4, 0.02) + rng.uniform(0, 0.01, len(truth))
    eps[rng.random(len(truth)) < 0.3] = np.nan  # some never scored
    return [f"p{i}" for i in range(len(truth))], x, eps, truth


def test_kmeans_beats_uniform_on_diversity_and_eps():
    ids, x, eps, truth = _pool()
    rows, cents = select_kmeans(ids, x, eps, batch=64, k_max=8, temperature=0.1, bonus=0.05, seed=1)
    uni = select_uniform(ids, 64, seed=1)
    idx = {p: i for i, p in enumerate(ids)}
    k_idx = np.array([idx[p] for p in rows["prompt_id"]])
    u_idx = np.array([idx[p] for p in uni["prompt_id"]])
    assert len(set(rows["prompt_id"])) == 64
    scored = np.nan_to_num(eps, nan=np.nanmean(eps))
    assert scored[k_idx].mean() > scored[u_idx].mean() + 0.05
    # kmeans concentrates on high-gap clusters but its batch still spans several of them
    assert cluster_entropy(truth[k_idx]) > 1.0
    assert set(rows.columns) == {"prompt_id", "cluster", "weight", "reason"}
    assert rows["weight"].min() > 0 and cents["weight"].sum() == pytest.approx(1.0)
    assert rows["reason"].str.starts_with("kmeans: cluster").all()


def test_warm_start_keeps_centroids_stable():
    ids, x, eps, _ = _pool(seed=2)
    _, c1 = select_kmeans(ids, x, eps, batch=32, k_max=8, seed=3)
    init = np.asarray(c1["vector"].to_list(), np.float32)
    _, c2 = select_kmeans(ids, x, eps, batch=32, k_max=8, init=init, seed=99)
    assert np.allclose(np.asarray(c2["vector"].to_list()), init, atol=1e-3)  # converged: warm start is a fixed point


@pytest.mark.parametrize("eps", [
    np.zeros(40),                                  # every group flat or solved: EPS 0 everywhere
    np.full(40, np.nan),                           # round 0: nothing scored yet
    np.where(np.arange(40) % 10 == 0, 0.3, 0.0),   # 4 prompts with a gap, far fewer than the batch
])
def test_bonus_zero_selects_a_full_batch(eps):
    """select.bonus = 0 is allowed: a cluster whose members are all valued 0 is drawn uniformly, and members
    with a positive value are all drawn before any zero-valued one (the limit of bonus -> 0+)."""
    ids, x, _, _ = _pool(seed=4, clusters=4, per=10)
    rows, cents = select_kmeans(ids, x, eps, batch=16, k_max=4, bonus=0.0, seed=5)
    picked = [int(p[1:]) for p in rows["prompt_id"]]
    assert len(set(picked)) == 16 and np.isfinite(cents["weight"].to_numpy()).all()
    positive = set(np.nonzero(np.nan_to_num(eps) > 0)[0].tolist())
    assert positive <= set(picked)


def test_dapo_filter_draws_the_first_generation_batch():
    """dapo_filter selects DAPO's first generation batch, ceil(oversample * B) candidates drawn uniformly; the
    zero-variance groups are dropped after generation and refilled in the collect stage (tests/test_dapo.py)."""
    ids = [f"p{i}" for i in range(20)]
    got = select_dapo_filter(ids, batch=4, oversample=1.5, seed=0)["prompt_id"].to_list()
    assert len(got) == len(set(got)) == 6 and set(got) <= set(ids)
    assert got == select_dapo_filter(ids, 4, 1.5, seed=0)["prompt_id"].to_list()
    assert got != select_dapo_filter(ids, 4, 1.5, seed=1)["prompt_id"].to_list()
    assert select_dapo_filter(ids, batch=8, oversample=3.0).height == 20  # no more than the candidates


def test_embeddings_are_cached_in_the_store(store):
    from tasks.selectors.embed import cached_embeddings

    prompts = pl.DataFrame({"prompt_id": ["a", "b"], "text": ["What is 2 + 2?", "Compute 7 * 8."]})
    x1, fresh1 = cached_embeddings(store, prompts, "hashing")
    more = pl.DataFrame({"prompt_id": ["b", "c", "a"], "text": ["Compute 7 * 8.", "Sum 1 and 9.", "What is 2 + 2?"]})
    x2, fresh2 = cached_embeddings(store, more, "hashing")
    assert (fresh1, fresh2) == (2, 1)
    assert np.allclose(x2[0], x1[1]) and np.allclose(x2[2], x1[0])
    assert np.allclose(np.linalg.norm(x2, axis=1), 1.0)


def test_minilm_embeds_offline_and_separates_topics():
    from tasks.selectors.embed import embed_minilm

    v = embed_minilm(["What is 7 times 8?", "Compute the product of 6 and 9.", "Write a poem about the sea."])
    assert v.shape == (3, 384) and np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert v[0] @ v[1] > v[0] @ v[2]


def test_a_stage_that_embeds_drops_the_embedder_when_it_ends(store):
    """MiniLM lives for the stage that embeds, not through collect and training (tasks/selectors/embed.py
    release_embedder, called by every stage's wrapper), and loads again for the next stage that needs it."""
    from tasks.selectors.embed import _minilm, embed_minilm
    from tasks.stage import stage

    held = []

    @stage("probe_embed")
    def probe(ctx, store):
        embed_minilm(["What is 7 times 8?"])
        embed_minilm(["Compute the product of 6 and 9."])  # the second call reuses the loaded model
        held.append(_minilm.cache_info().currsize)
        return {}

    probe.fn(round_ctx(store, "r"))
    assert held == [1] and _minilm.cache_info().currsize == 0
    assert embed_minilm(["Write a poem about the sea."]).shape == (1, 384)  # loads again on demand


def test_policy_embeddings_of_each_checkpoint_are_cached_apart(store, tiny_backend):
    """A new checkpoint embeds the same prompts again (its hidden states differ) and lands them under its own
    key; asking again for either checkpoint computes nothing."""
    from tasks.selectors.embed import cached_embeddings

    prompts = pl.DataFrame({"prompt_id": ["a", "b"], "text": ["What is 2 + 2?", "Compute 7 * 8."]})
    assert cached_embeddings(store, prompts, "policy", tiny_backend, namespace="v0")[1] == 2
    assert cached_embeddings(store, prompts, "policy", tiny_backend, namespace="v1")[1] == 2
    assert cached_embeddings(store, prompts, "policy", tiny_backend, namespace="v0")[1] == 0
    assert cached_embeddings(store, prompts, "policy", tiny_backend, namespace="v1")[1] == 0


def _land_pool(store, run_id: str, rounds: int, n: int = 24) -> None:
    import pyarrow as pa

    from tests.conftest import prompt_rows

    ids = prompt_rows(n)["prompt_id"].to_pylist()
    if not store.files("prompts"):
        store.commit("ingest-sel", {"prompts": prompt_rows(n)})
    for r in range(rounds):
        store.commit("pool", {"pool": pa.table({"run_id": [run_id] * n, "round": pa.array([r] * n, pa.int32()),
                                                "prompt_id": ids, "status": ["active"] * n})}, run_id=run_id, round=r)


def test_warm_start_is_keyed_to_the_embedding_space(store, tiny_backend):
    """The policy's hidden states are another space after every checkpoint: round 1, sampled by v1, clusters
    afresh instead of starting from v0's centroids; a round whose policy did not change, and MiniLM (whose
    space never changes), warm-start. Each round's centroids and vectors are stored under their space."""
    import datetime as dt

    import pyarrow as pa

    from flows.config import ModelConfig, SelectConfig
    from models.checkpoints import save_checkpoint
    from storage.query import sql
    from tasks.select import select_task

    cfg = SelectConfig(embedder="policy", batch_size=8, k_max=4)
    _land_pool(store, "p", rounds=3)
    base = ModelConfig(policy="tiny-random")
    s0 = select_task.fn(round_ctx(store, "p", 0, model=base), cfg, include_reserve=False)
    v1 = save_checkpoint(tiny_backend.model, tiny_backend.tokenizer, store, "p", 1)
    store.commit("train", {"checkpoints": pa.table({
        "run_id": ["p"], "policy_version": pa.array([1], pa.int32()), "parent_version": pa.array([0], pa.int32()),
        "round": pa.array([0], pa.int32()), "path": [str(v1)], "created_at": [dt.datetime.now(dt.UTC)]})},
        run_id="p", round=0)
    new = ModelConfig(policy=str(v1))
    s1 = select_task.fn(round_ctx(store, "p", 1, model=new), cfg, include_reserve=False)
    s2 = select_task.fn(round_ctx(store, "p", 2, model=new), cfg, include_reserve=False)  # still v1: the same space
    assert [s["embedding_space"] for s in (s0, s1, s2)] == ["policy:tiny-random", "policy:p/v1", "policy:p/v1"]
    assert [s["warm_start"] for s in (s0, s1, s2)] == [False, False, True]
    assert [s["embedded"] for s in (s0, s1, s2)] == [24, 24, 0]  # v1 embeds every prompt again, once
    stored = sql(store, "SELECT round, embedder, count(*) AS k FROM centroids GROUP BY ALL ORDER BY round").to_pylist()
    assert stored == [{"round": 0, "embedder": "policy:tiny-random", "k": 3}, {"round": 1, "embedder": "policy:p/v1", "k": 3},
                      {"round": 2, "embedder": "policy:p/v1", "k": 3}]
    vectors = sql(store, "SELECT embedder, count(*) AS n FROM embeddings GROUP BY ALL ORDER BY 1").to_pylist()
    assert vectors == [{"embedder": "policy:p/v1", "n": 24}, {"embedder": "policy:tiny-random", "n": 24}]

    minilm = SelectConfig(embedder="minilm", batch_size=8, k_max=4)
    _land_pool(store, "m", rounds=2)
    m0 = select_task.fn(round_ctx(store, "m", 0, model=base), minilm, include_reserve=False)
    m1 = select_task.fn(round_ctx(store, "m", 1, model=new), minilm, include_reserve=False)  # a new checkpoint: MiniLM's space stays
    assert (m0["embedding_space"], m1["embedding_space"]) == ("minilm", "minilm")
    assert (m0["warm_start"], m1["warm_start"]) == (False, True)


def _land_scores(store, run_id: str, round: int, eps: dict[str, float]) -> None:
    import pyarrow as pa

    n = len(eps)
    store.commit("score", {"prompt_scores": pa.table({
        "run_id": [run_id] * n, "round": pa.array([round] * n, pa.int32()),
        "policy_version": pa.array([round] * n, pa.int32()), "prompt_id": list(eps), "n": pa.array([8] * n, pa.int32()),
        "mean_reward": [0.5] * n, "std_reward": [0.5] * n, "eps": list(eps.values()),
        "bucket": ["informative"] * n})}, run_id=run_id, round=round)


def test_never_scored_means_never_in_this_run(store):
    """At round 3 a prompt scored in round 0 only is scored (its EPS is round 0's), a prompt scored in rounds 0
    and 2 is valued at its latest score, and only prompts no earlier round of this run scored get the bonus;
    another run's scores, and the round's own, count for nothing."""
    from flows.config import ModelConfig, SelectConfig
    from storage.query import sql
    from tasks.select import select_task

    _land_pool(store, "r", rounds=4, n=24)
    ids = sorted(r["prompt_id"] for r in sql(store, "SELECT DISTINCT prompt_id FROM pool").to_pylist())
    _land_scores(store, "r", 0, {ids[0]: 0.11, ids[1]: 0.12})
    _land_scores(store, "r", 2, {ids[1]: 0.22, ids[2]: 0.23})
    _land_scores(store, "other", 2, {ids[3]: 0.34})
    _land_scores(store, "r", 3, {ids[4]: 0.45})  # the round being selected has not been scored: a stale row
    cfg = SelectConfig(embedder="hashing", batch_size=24, k_max=3)  # the whole pool: every reason is shown
    summary = select_task.fn(round_ctx(store, "r", 3, model=ModelConfig(policy="tiny-random")), cfg, include_reserve=False)
    rows = sql(store, "SELECT prompt_id, reason FROM selections WHERE run_id = 'r' AND round = 3").to_pylist()
    reasons = {r["prompt_id"]: r["reason"].split(", ")[-1] for r in rows}  # "kmeans: cluster c quota q/n, <value>"
    assert [reasons[i] for i in ids[:5]] == ["EPS 0.110", "EPS 0.220", "EPS 0.230", "never scored", "never scored"]
    assert summary["selected_unscored"] == 21
    assert summary["mean_eps_pool"] == pytest.approx((0.11 + 0.22 + 0.23) / 3, abs=1e-4)  # rounded by sig4

