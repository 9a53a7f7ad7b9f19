"""Versioned policy checkpoints: one folder per (run, policy_version), recorded in the store's `checkpoints`.

Layout: `<store>/_checkpoints/run_id=<run>/v<version>/` (a transformers folder: config, safetensors weights,
tokenizer). A folder is written under a temporary name and renamed into place; it only counts once the train
stage that made it has landed its `checkpoints` row, so a crash mid-save leaves nothing a reader would use,
and the rerun overwrites it (on a remote store the upload has no rename: the rerun uploads the same file
names over a crashed upload's objects). Version 0 is the run's starting model; its row names the base as
`recorded_spec` has it (a built-in name as it is, so that the store moves between machines; else resolved).
For a remote root (s3://...) the folder is written in the local model cache (transformers loads local
folders) and then uploaded to `<store>/_checkpoints/run_id=<run>/v<version>/`, and the row records that URI,
so any host can continue the run: `local_copy` fetches a recorded remote folder into its own cache once.
Which checkpoints a run has, and its newest, are store bookkeeping: storage/checkpoints.py.

Retention (`train.keep_checkpoints = "evaluated"`, `prune_checkpoints`): after each round the flow deletes the
folders of the run's versions that are neither its newest two nor evaluated (any `evals` row: a milestone, the
run's end, a `refinery eval`); version 0 is the base model and never touched. The one before the newest is the
policy that sampled the last round: a resume that raises `rounds` runs that round's refine, whose teacher is by
default the policy. Only a folder this store keeps for this run (`_checkpoints/run_id=<run>/v<N>`, locally or
under a remote root, and its local cache copy) is ever deleted:
a recorded path is data, and a row naming any other folder is skipped. The `checkpoints` rows stay, so lineage
and the curves still name every version; `refinery eval` of a pruned version says it was pruned.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

import polars as pl

from models.cache import BUILT_IN
from storage.checkpoints import checkpoint_versions, newest_checkpoint
from storage.query import scan
from storage.store import Store

_RECORDED = re.compile(r"^run_id=[A-Za-z0-9][A-Za-z0-9_.-]{0,127}/v[0-9]+$")


def checkpoint_root(store: Store) -> Path:
    if store.local:
        return Path(store.root, "_checkpoints")
    from models.cache import cache_dir

    return cache_dir() / "checkpoints" / store.root.replace("://", "_").replace("/", "_")


def checkpoint_dir(store: Store, run_id: str, version: int) -> Path:
    return checkpoint_root(store) / f"run_id={run_id}" / f"v{version}"


def remote_checkpoint(store: Store, run_id: str, version: int) -> str:
    """Where a remote store keeps checkpoint `version` of `run_id` (a URI)."""
    return store.full(f"_checkpoints/run_id={run_id}/v{version}")


def local_copy(store: Store, path: str) -> str:
    """A local folder holding the recorded checkpoint `path`: `path` itself, unless it is a URI of this
    (remote) store, which is fetched into the local cache once (into a temporary folder, then renamed)."""
    if store.local or "://" not in path:
        return path
    prefix = store.full("_checkpoints") + "/"
    if not path.startswith(prefix):
        return path
    tail = path[len(prefix):]
    if not _RECORDED.match(tail):  # a row is data: never let it name a folder outside the cache
        raise ValueError(f"checkpoint path {path!r} is not <store>/_checkpoints/run_id=<run>/v<N>")
    dest = checkpoint_root(store) / tail
    dest.parent.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(str(dest.parent / f".{dest.name}.fetch.lock")):  # one fetch per folder and host
        if (dest / "config.json").is_file():
            return str(dest)
        tmp = dest.parent / f".{dest.name}.{uuid.uuid4().hex}.fetch"
        try:
            store.fs.get(store.fs._strip_protocol(path) + "/", str(tmp) + "/", recursive=True)
            if not (tmp / "config.json").is_file():
                raise FileNotFoundError(path)
            if dest.exists():  # an incomplete folder (no config.json) of an earlier, broken save
                shutil.rmtree(dest)
            os.replace(tmp, dest)
        except FileNotFoundError:
            raise FileNotFoundError(f"checkpoint {path} is recorded but missing from the store") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(dest)


def save_checkpoint(model, tokenizer, store: Store, run_id: str, version: int) -> str:
    """Write the model (full weights, or a LoRA model merged into them) and its tokenizer; return where it is
    recorded (the folder, or for a remote store the URI it was uploaded to)."""
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
    if store.local:
        return str(dest)
    # uploaded before the train stage commits its row: a crash mid-upload leaves objects no row names, and the
    # stage's rerun uploads the same files again over them
    remote = remote_checkpoint(store, run_id, version)
    store.fs.put(str(dest) + "/", store.fs._strip_protocol(remote) + "/", recursive=True)
    return remote




def policy_for_round(store: Store, run_id: str, round: int, base: str,
                     need_weights: bool = True) -> tuple[int, str]:
    """(policy_version, model spec) that samples round `round`: the newest checkpoint made before it, else the
    configured base model as version 0. Raises FileNotFoundError when that checkpoint's folder is gone, unless
    `need_weights` is off (a landed round on resume: nothing loads it, and retention may have deleted it);
    then the recorded path comes back as it is, unfetched."""
    version, path = newest_checkpoint(store, run_id, base, before_round=round)
    if version and (not need_weights or path in BUILT_IN):  # a built-in name: an update-less round's version
        return version, path
    if version:
        path = local_copy(store, path)
    if version and not Path(path).is_dir():
        raise FileNotFoundError(f"run {run_id}: checkpoint v{version} is recorded at {path}, but that folder is gone")
    return version, path


def own_folder(store: Store, run_id: str, version: int, path: str) -> bool:
    """Is `path` (as `checkpoint_versions` resolves it) the folder this store keeps for `run_id`'s `version`?"""
    if store.local:
        return Path(path).resolve() == checkpoint_dir(store, run_id, version).resolve()
    return path.rstrip("/") == remote_checkpoint(store, run_id, version)


def checkpoint_gone(store: Store, path: str) -> bool:
    """Is a recorded checkpoint folder missing (pruned, or deleted by hand)?"""
    if path in BUILT_IN:  # an update-less round's version is the built-in base, rebuilt wherever it is read
        return False
    if store.local or "://" not in path:
        return not Path(path).is_dir()
    return not store.fs.exists(store.fs._strip_protocol(path) + "/config.json")


def prune_checkpoints(store: Store, run_id: str) -> list[int]:
    """Delete the folders of `run_id`'s checkpoints that are neither its newest two versions nor evaluated
    (module docstring); returns the versions deleted now (a folder already gone is not counted)."""
    known = checkpoint_versions(store, run_id)
    if known.height == 0:
        return []
    versions = sorted(int(v) for v in known["policy_version"].unique())
    newest = versions[-1]
    last_sampler = versions[-2] if len(versions) > 1 else 0  # the policy of the newest round (module docstring)
    evaluated = set(scan(store, "evals").filter(pl.col("run_id") == run_id).select("policy_version").unique()
                    .collect()["policy_version"].to_list())
    # a round that trained nothing records its version at its parent's folder: a folder kept by any kept version
    keep = {0, newest, last_sampler} | evaluated
    kept = {str(p) for v, p in known.select("policy_version", "path").iter_rows() if v in keep}
    gone = []
    for version, path in known.select("policy_version", "path").iter_rows():
        if version in keep or str(path) in kept or not own_folder(store, run_id, version, path):
            continue
        cached = checkpoint_dir(store, run_id, version)
        if store.local:
            if not cached.is_dir():
                continue
        elif store.fs.exists(store.fs._strip_protocol(path)):
            store.fs.rm(store.fs._strip_protocol(path), recursive=True)
        else:
            continue
        shutil.rmtree(cached, ignore_errors=True)  # the folder (local) or its cache copy (remote)
        gone.append(int(version))
    return gone

