"""Generation sharded over a Ray cluster: the `[scale]` config section and a backend that fans each generate
call out over N Ray actors, each holding its own copy of the policy.

- Which stages: collect (with LoPE and DAPO's batches), evaluate and rescore load their backend through
  `load_generator(model, scale)`; with `scale.rollout_workers` > 1 that is a `ShardedBackend`.
  Everything else (chat template, tokenizer, scoring, MCMC shaping, training) stays in the flow's process.
- How a call is split: the prompts (each with its G samples) are cut into `rollout_workers` contiguous shards
  of near-equal size, one per actor; the results come back through Ray's object store in prompt order, and
  the flow verifies them and commits the stage once, as in one process: atomicity and resume are unchanged
  (a killed stage lands nothing; the rerun generates again). Rows cross the object store, not part files:
  a round's rollouts are a few MB, and one writer keeps the single commit point simple.
- Why the rows are the same: every caller passes keyed row seeds (tasks/core/seeds.py `row_seeds`, one per
  prompt id), and keyed sampling draws each row's tokens from its own key alone (models/hf/decoding.py), so a
  prompt's samples do not depend on which shard or batch generated it. The sharded stage writes the rows one
  process writes (tests/test_ray_shard.py compares row hashes on a local two-worker cluster). That holds
  where a row's logits do not depend on what else is in its batch, as on CPU in fp32 (vLLM's CPU engine
  included: tests/test_vllm_cpu.py shards collect over 2 vLLM workers); in bf16 on a GPU batch shapes change
  the logits in their last bits and a draw near a boundary can differ, so there the rows agree in
  distribution, not bit for bit. A call without row seeds is refused: its rows
  would depend on the split.
- Actors: created once per process and scale setting, each with `cpus_per_worker` CPUs and
  `gpus_per_worker` GPUs; a new checkpoint is loaded into the same actors (`load`), which drop the previous
  one. The flow's process keeps its own copy of the policy for rendering and scoring.
- Cluster: `ray_address = "local"` starts a Ray instance on this machine (sized to the workers), "auto"
  joins the cluster this machine belongs to, "ray://host:10001" connects a client. Workers on other hosts
  must import this package and read the checkpoint at the path the flow's process names (a shared
  filesystem); fetching a remote store's checkpoint on each worker is not wired yet.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from pydantic import Field

from models.backend import Backend, Completion, Sampling
from models.config import ModelConfig, Section
from models.registry import load_model, release_backends


class ScaleConfig(Section):
    """Where generation runs: in the flow's process, or sharded over Ray workers."""

    rollout_workers: int = Field(1, ge=1, le=4096, description="workers that collect, LoPE, evaluate and rescore "
                                 "generate on, each with its own copy of the policy (1: in the flow's process, "
                                 "no Ray); the rows are the same for any number")
    ray_address: str = Field("local", pattern=r"^(local|auto|ray://[A-Za-z0-9_.:\[\]-]+)$",
                             description="the Ray cluster when rollout_workers > 1: local (start one on this "
                             "machine), auto (the cluster this machine belongs to) or ray://host:port")
    cpus_per_worker: float = Field(1.0, gt=0.0, le=1024.0, description="CPUs Ray reserves per worker")
    gpus_per_worker: float = Field(0.0, ge=0.0, le=64.0, description="GPUs Ray reserves per worker (0: CPU workers)")


def shards(n_items: int, n_shards: int) -> list[range]:
    """Contiguous index ranges of near-equal size covering 0..n_items-1 (the first ones one longer), no empty
    range.

    >>> shards(5, 2), shards(1, 3)
    ([range(0, 3), range(3, 5)], [range(0, 1)])
    """
    n_shards = max(1, min(n_shards, n_items))
    size, extra = divmod(n_items, n_shards)
    out, at = [], 0
    for i in range(n_shards):
        step = size + (i < extra)
        out.append(range(at, at + step))
        at += step
    return out


def _ray():
    try:
        import ray
    except ImportError:
        raise ImportError("scale.rollout_workers > 1 needs Ray: pip install 'curriculum-refinery[distributed]'") \
            from None
    return ray


def connect(scale: ScaleConfig):
    """Ray, initialised for `scale` (once per process; an existing connection is kept)."""
    ray = _ray()
    if not ray.is_initialized():
        if scale.ray_address == "local":
            cpus = max(os.cpu_count() or 1, int(scale.rollout_workers * scale.cpus_per_worker + 0.999))
            ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
        else:
            ray.init(address=scale.ray_address, log_to_driver=False, configure_logging=False)
    return ray


class GenerationWorker:
    """One Ray actor's state: the policy it holds. Loaded through models.registry like the flow's own."""

    def __init__(self, threads: int = 1):
        import torch

        torch.set_num_threads(max(1, threads))  # the CPUs Ray reserved for this actor (models/threads.py)
        self.spec: dict | None = None
        self.backend = None
        self.prompts = 0  # prompts generated for, over the actor's life

    def stats(self) -> tuple[int, int]:
        """(process id, prompts generated for): where the work ran, for tests and logs."""
        return os.getpid(), self.prompts

    def holds(self) -> str:
        """The name of the backend this actor generates on ('' before its first load)."""
        return self.backend.name if self.backend is not None else ""

    def load(self, model: dict) -> str:
        if model != self.spec:
            self.backend = None
            release_backends()  # one policy per worker: the previous checkpoint goes first
            self.backend, self.spec = load_model(ModelConfig.model_validate(model)), model
        return self.backend.name

    def generate(self, prompts: list[str], n: int, sampling: Sampling, row_seeds: list[int]) -> list[list[Completion]]:
        self.prompts += len(prompts)
        return self.backend.generate(prompts, n, sampling, row_seeds=row_seeds)

    def generate_ids(self, ids: list[list[int]], n: int, sampling: Sampling,
                     row_seeds: list[int]) -> list[list[Completion]]:
        self.prompts += len(ids)
        return self.backend.generate_ids(ids, n, sampling, row_seeds=row_seeds)


_ACTORS: dict[tuple, list] = {}  # (scale settings) -> the actors, reused across rounds and stages


def actors(scale: ScaleConfig) -> list:
    key = (scale.rollout_workers, scale.ray_address, scale.cpus_per_worker, scale.gpus_per_worker)
    if key not in _ACTORS:
        ray = connect(scale)
        remote = ray.remote(num_cpus=scale.cpus_per_worker, num_gpus=scale.gpus_per_worker)(GenerationWorker)
        threads = max(1, int(scale.cpus_per_worker))
        _ACTORS[key] = [remote.remote(threads) for _ in range(scale.rollout_workers)]
    return _ACTORS[key]


def shutdown() -> None:
    """Drop the actors and disconnect from Ray (tests; a process that ends does this anyway)."""
    _ACTORS.clear()
    ray = _ray()
    if ray.is_initialized():
        ray.shutdown()


class ShardedBackend:
    """A backend whose generate calls run on Ray actors (module docstring); every other call goes to the
    flow-side copy `local` (rendering, tokenizer, scoring)."""

    def __init__(self, local, model: ModelConfig, scale: ScaleConfig):
        self.local = local
        self.name = f"{local.name} x{scale.rollout_workers} Ray workers"
        self.workers = actors(scale)
        ray = _ray()
        ray.get([w.load.remote(model.model_dump(mode="json")) for w in self.workers])

    def __getattr__(self, attr):  # tokenizer, eos_ids, encode, render, score, score_ids, ...
        return getattr(self.local, attr)

    def _fan_out(self, method: str, items: list, n: int, sampling: Sampling,
                 progress: Callable[[int], None] | None, row_seeds: list[int] | None) -> list[list[Completion]]:
        if row_seeds is None or len(row_seeds) != len(items):
            raise ValueError("sharded generation needs one row seed per prompt (keyed sampling); without them "
                             "the rows would depend on how the prompts were split")
        if not items:
            return []
        ray = _ray()
        parts = shards(len(items), len(self.workers))
        pending = {getattr(w, method).remote([items[i] for i in part], n, sampling, [row_seeds[i] for i in part]): k
                   for k, (w, part) in enumerate(zip(self.workers, parts))}
        done: dict[int, list[list[Completion]]] = {}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            k = pending.pop(ready[0])
            done[k] = ray.get(ready[0])
            if progress:
                progress(len(parts[k]) * n)
        return [group for k in range(len(parts)) for group in done[k]]

    def generate(self, prompts: list[str], n: int, sampling: Sampling, progress: Callable[[int], None] | None = None,
                 row_seeds: list[int] | None = None) -> list[list[Completion]]:
        return self._fan_out("generate", prompts, n, sampling, progress, row_seeds)

    def generate_ids(self, ids: list[list[int]], n: int, sampling: Sampling,
                     progress: Callable[[int], None] | None = None,
                     row_seeds: list[int] | None = None) -> list[list[Completion]]:
        return self._fan_out("generate_ids", ids, n, sampling, progress, row_seeds)


def load_generator(model: ModelConfig, scale: ScaleConfig | None = None) -> Backend:
    """The backend a generating stage uses: the model section's own (models/registry.py load_model), or, with
    more than one rollout worker, that backend with its generate calls sharded over Ray workers."""
    local = load_model(model)
    if scale is None or scale.rollout_workers <= 1:
        return local
    return ShardedBackend(local, model, scale)
