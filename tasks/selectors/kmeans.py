"""`kmeans`: EPS-weighted k-means diverse selection ("Diversify and Conquer", arXiv 2409.11378; docs/algorithms.md
§4). The math is tasks/core/selection.py `select_kmeans`: K = min(k_max, ceil(n / 8)) clusters of the candidates'
embeddings, warm-started from last round's centroids in the same embedding space; cluster weights softmax(mean
EPS / T_sel), never-scored members valued at the scored mean plus `bonus`; the batch split over clusters by
weight, and drawn inside each in proportion to EPS + bonus. Its centroids land in `centroids`.
"""

from __future__ import annotations

from tasks.core.selection import cluster_entropy, select_kmeans
from tasks.reporting.progress import sig4
from tasks.selectors.base import Candidates, Picks, RoundView, Selector, Settings, register


@register
class KMeans(Selector):
    name = "kmeans"
    description = "EPS-weighted clusters of prompt embeddings"
    needs_embeddings = True

    def select(self, candidates: Candidates, view: RoundView, cfg: Settings) -> Picks:
        x, init = candidates.x, candidates.init
        rows, cents = select_kmeans(candidates.ids, x, candidates.eps, cfg.batch_size, cfg.k_max, cfg.temperature,
                                    cfg.bonus, init, view.seed, cfg.minibatch_above)
        warm = init is not None and init.shape == (cents.height, x.shape[1])
        return Picks(rows, cents, {"clusters": int(cents.height), "warm_start": warm,
                                   "cluster_entropy": sig4(cluster_entropy(rows["cluster"].to_numpy()))})
