"""Selection algorithms: k-means diverse selection ("Diversify and Conquer", arXiv 2409.11378; docs/algorithms.md §4),
with the remaining gap measured by EPS, plus the `uniform` and `dapo_filter` baselines' draws. The selectors that
call them, one file each behind one protocol, are in tasks/selectors/.

kmeans: embed the candidates; K = min(k_max, ceil(n/8)) clusters, warm-started from last round's centroids
when they live in the same embedding space (tasks/selectors/embed.py holds the embedder, and for `policy` the checkpoint;
a new checkpoint's hidden states are another space, where old centroids mean nothing, so it starts afresh);
u_c = mean EPS of the scored members (members never scored count as the mean of the scored ones plus an
exploration bonus); w_c = softmax(u_c / T_sel); the batch is split over clusters by w with largest-remainder
rounding, capped at each cluster's size (the excess is re-split over clusters with room); inside a cluster,
members are drawn without replacement with probability proportional to EPS + bonus.

Choices: "never scored" means no earlier round of this run scored the prompt, and a scored prompt's EPS is its
latest score (a prompt not selected last round keeps the EPS it had, rather than passing for new and taking
the bonus again). With bonus = 0 (allowed), members valued 0 are drawn only once a cluster's positive-valued
members are all taken, uniformly among themselves: the limit of bonus -> 0+, so an all-zero cluster (every
group flat or solved) is drawn uniformly instead of dividing 0 by 0.
"""

from __future__ import annotations

import math

import numpy as np
import polars as pl

from tasks.core.dapo import draw_order, first_batch_size


def n_clusters(n: int, k_max: int = 64) -> int:
    return max(1, min(k_max, math.ceil(n / 8), n))


def kmeans(x: np.ndarray, k: int, init: np.ndarray | None = None, seed: int = 0, max_iter: int = 50,
           minibatch_above: int = 20_000):
    """(labels, centroids). Warm-starts from `init` when it has k rows of the right width; above
    `minibatch_above` points, MiniBatchKMeans (batches of 4096) replaces full Lloyd iterations."""
    from sklearn.cluster import KMeans, MiniBatchKMeans

    warm = init is not None and init.shape == (k, x.shape[1])
    if x.shape[0] > minibatch_above:
        km = MiniBatchKMeans(k, init=init if warm else "k-means++", n_init=1, random_state=seed,
                             batch_size=4096, max_iter=max_iter)
    else:
        km = KMeans(k, init=init if warm else "k-means++", n_init=1, random_state=seed, max_iter=max_iter)
    labels = km.fit_predict(x)
    return labels.astype(np.int32), km.cluster_centers_.astype(np.float32)


def cluster_utility(labels: np.ndarray, eps: np.ndarray, k: int, bonus: float) -> np.ndarray:
    """u_c: mean EPS of scored members (eps is NaN where never scored), never-scored members valued at the mean
    of all scored prompts plus `bonus`."""
    scored = ~np.isnan(eps)
    fill = (eps[scored].mean() if scored.any() else 0.0) + bonus
    value = np.where(scored, eps, fill)
    sums = np.bincount(labels, weights=value, minlength=k)
    counts = np.bincount(labels, minlength=k)
    return np.divide(sums, counts, out=np.full(k, -np.inf), where=counts > 0)


def softmax_weights(u: np.ndarray, temperature: float) -> np.ndarray:
    z = np.where(np.isfinite(u), u / temperature, -np.inf)
    z = z - z[np.isfinite(z)].max()
    e = np.exp(z)
    return e / e.sum()


def allocate(batch: int, weights: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Split `batch` over clusters by `weights` (largest remainder), never above a cluster's size; the
    excess of full clusters is split again over those with room.

    >>> allocate(10, np.array([0.5, 0.3, 0.2]), np.array([100, 100, 100])).tolist()
    [5, 3, 2]
    >>> allocate(10, np.array([0.8, 0.1, 0.1]), np.array([2, 100, 100])).tolist()
    [2, 4, 4]
    """
    sizes = sizes.astype(np.int64)
    batch = min(batch, int(sizes.sum()))
    counts = np.zeros_like(sizes)
    while counts.sum() < batch:
        room = sizes - counts
        w = np.where(room > 0, weights, 0.0)
        if w.sum() <= 0:
            w = (room > 0).astype(float)
        w = w / w.sum()
        left = batch - counts.sum()
        exact = w * left
        add = np.floor(exact).astype(np.int64)
        rest = left - add.sum()
        if rest:
            order = np.lexsort((np.arange(len(w)), -(exact - add)))  # largest remainder, ties by index
            add[order[:rest]] += 1
        counts += np.minimum(add, room)
    return counts


def draw_proportional(rng: np.random.Generator, members: np.ndarray, value: np.ndarray, size: int) -> np.ndarray:
    """`size` members drawn without replacement with probability proportional to `value` (>= 0). Zero-valued
    members come only after every positive one is drawn, uniformly among themselves: the limit of a tiny
    positive value, and no 0/0 when a cluster is all zeros (bonus = 0 and every EPS 0).

    >>> draw_proportional(np.random.default_rng(0), np.arange(4), np.array([0.0, 0.5, 0.0, 0.2]), 3)[:2].tolist()
    [1, 3]
    """
    positive = members[value[members] > 0]
    take = min(size, len(positive))
    first = (rng.choice(positive, size=take, replace=False, p=value[positive] / value[positive].sum())
             if take else np.array([], np.int64))
    zero = members[~(value[members] > 0)]
    rest = rng.choice(zero, size=size - take, replace=False) if size > take else np.array([], np.int64)
    return np.concatenate([first, rest]).astype(np.int64)


def select_kmeans(prompt_ids: list[str], x: np.ndarray, eps: np.ndarray, batch: int, k_max: int = 64,
                  temperature: float = 0.1, bonus: float = 0.1, init: np.ndarray | None = None,
                  seed: int = 0, minibatch_above: int = 20_000) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Returns (selection rows: prompt_id, cluster, weight, reason; centroids: cluster, size, utility,
    weight, vector)."""
    rng = np.random.default_rng(seed)
    k = n_clusters(len(prompt_ids), k_max)
    labels, centers = kmeans(x, k, init, seed, minibatch_above=minibatch_above)
    u = cluster_utility(labels, eps, k, bonus)
    w = softmax_weights(u, temperature)
    sizes = np.bincount(labels, minlength=k)
    quota = allocate(batch, w, sizes)
    scored = ~np.isnan(eps)
    fill = (eps[scored].mean() if scored.any() else 0.0)
    value = np.where(scored, eps, fill) + bonus  # + bonus keeps zero-EPS members reachable
    chosen, reasons = [], []
    for c in np.nonzero(quota)[0]:
        picks = draw_proportional(rng, np.nonzero(labels == c)[0], value, quota[c])
        chosen += picks.tolist()
        reasons += [f"kmeans: cluster {c} quota {quota[c]}/{sizes[c]}, "
                    + (f"EPS {eps[i]:.3f}" if scored[i] else "never scored") for i in picks]
    chosen_arr = np.asarray(chosen, dtype=np.int64)
    rows = pl.DataFrame({
        "prompt_id": [prompt_ids[i] for i in chosen],
        "cluster": labels[chosen_arr] if chosen else np.array([], np.int32),
        "weight": w[labels[chosen_arr]] if chosen else np.array([], float),
        "reason": reasons,
    }, schema={"prompt_id": pl.String, "cluster": pl.Int32, "weight": pl.Float64, "reason": pl.String})
    cents = pl.DataFrame({"cluster": np.arange(k, dtype=np.int32), "size": sizes.astype(np.int32),
                          "utility": np.where(np.isfinite(u), u, np.nan), "weight": w,
                          "vector": list(centers)})
    return rows, cents


def select_uniform(prompt_ids: list[str], batch: int, seed: int = 0) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(prompt_ids), size=min(batch, len(prompt_ids)), replace=False)
    return pl.DataFrame({"prompt_id": [prompt_ids[i] for i in picks], "cluster": [None] * len(picks),
                         "weight": [None] * len(picks), "reason": ["uniform random"] * len(picks)},
                        schema={"prompt_id": pl.String, "cluster": pl.Int32, "weight": pl.Float64,
                                "reason": pl.String})


def select_dapo_filter(prompt_ids: list[str], batch: int, oversample: float, seed: int = 0) -> pl.DataFrame:
    """DAPO dynamic sampling's first generation batch (tasks/core/dapo.py): ceil(oversample * B) candidates, the
    head of a seeded uniform draw order. DAPO draws from the whole dataset, whatever a prompt scored before;
    the collect stage generates them, drops the zero-variance groups and refills from the same draw order."""
    picks = draw_order(prompt_ids, seed)[:first_batch_size(batch, oversample)]
    return pl.DataFrame({"prompt_id": picks, "cluster": [None] * len(picks), "weight": [None] * len(picks),
                         "reason": ["dapo_filter: generation batch 1"] * len(picks)},
                        schema={"prompt_id": pl.String, "cluster": pl.Int32, "weight": pl.Float64,
                                "reason": pl.String})


def cluster_entropy(labels: np.ndarray) -> float:
    """Shannon entropy (nats) of the cluster histogram of a batch: higher is more diverse."""
    _, counts = np.unique(labels, return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum())
