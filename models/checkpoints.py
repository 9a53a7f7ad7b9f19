"""Versioned policy checkpoints: one folder per (run, policy_version), recorded in the store's `checkpoints`.

Layout: `<store>/_checkpoints/run_id=<run>/v<version>/` (a transformers folder: config, safetensors weights,
tokenizer). A folder is written under a temporary name and renamed into place; it only counts once the train
stage that made it has landed its `checkpoints` row, so a crash mid-save leaves nothing a reader would use,
and the rerun overwrites it. Version 0 is the run's starting model; its row points at the resolved base.
For an object-store root the folders live in the local model cache instead (transformers loads local folders).
Which checkpoints a run has, and its newest, are store bookkeeping: storage/checkpoints.py.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from storage.checkpoints import newest_checkpoint
from storage.store import Store


def checkpoint_root(store: Store) -> Path:
    if store.local:
        return Path(store.root, "_checkpoints")
    from models.registry import cache_dir

    return cache_dir() / "checkpoints" / store.root.replace("://", "_").replace("/", "_")


def checkpoint_dir(store: Store, run_id: str, version: int) -> Path:
    return checkpoint_root(store) / f"run_id={run_id}" / f"v{version}"


def save_checkpoint(model, tokenizer, store: Store, run_id: str, version: int) -> Path:
    """Write the model (full weights, or a LoRA model merged into them) and its tokenizer; return the folder."""
    dest = checkpoint_dir(store, run_id, version)
    dest.parent.mkdir(parents=True, exist_ok=True)
    for stale in dest.parent.glob(f".v{version}.*.tmp"):  # a save that crashed half-way
        shutil.rmtree(stale, ignore_errors=True)
    tmp = dest.parent / f".v{version}.{uuid.uuid4().hex}.tmp"
    if hasattr(model, "merge_and_unload"):  # peft: a plain transformers checkpoint, loadable by every backend
        model = model.merge_and_unload()
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if dest.exists():  # an unrecorded folder from a run that crashed before its train stage landed
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    return dest




def policy_for_round(store: Store, run_id: str, round: int, base: str) -> tuple[int, str]:
    """(policy_version, model spec) that samples round `round`: the newest checkpoint made before it, else the
    configured base model as version 0. Raises FileNotFoundError when that checkpoint's folder is gone."""
    version, path = newest_checkpoint(store, run_id, base, before_round=round)
    if version and not Path(path).is_dir():
        raise FileNotFoundError(f"run {run_id}: checkpoint v{version} is recorded at {path}, but that folder is gone")
    return version, path
