"""Where this machine keeps built models, and names for weights that do not depend on where they lie.

`cache_root` is Refinery's cache ($REFINERY_CACHE, else $XDG_CACHE_HOME/refinery); the built-in models
(models/registry.py builds them: `default`, the embedded SmolLM2 converted once, and `tiny-random`) live in
its `models/` folder. `model_identity` names a loaded folder by its weights, for backends' names and through
them the teacher cache's keys. Nothing here imports a backend, so the backends may import it.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_DIR = "smollm2-135m-instruct"
TINY_DIR = "tiny-random-llama-v2"
BUILT_IN = ("default", "tiny-random")  # names models/registry.py `resolve` builds on any machine, in its cache


def cache_root() -> Path:
    """This machine's Refinery cache: $REFINERY_CACHE, else $XDG_CACHE_HOME/refinery (~/.cache/refinery)."""
    return Path(os.environ.get("REFINERY_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                / "refinery")


def cache_dir() -> Path:
    path = cache_root() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def model_identity(path: str) -> str:
    """The weights a loaded folder holds, named so that the name is the same on any machine and wherever the
    store lives: a built-in model's cache folder by the built-in's name, a run's checkpoint folder
    (`<store or cache>/_checkpoints/run_id=<run>/v<N>`) by `run_id=<run>/v<N>`, anything else as it is. A
    backend's `name` is built on it, and the teacher cache's key on that (tasks/strategies/teacher_calls.py), so
    a moved or copied store still finds the answers its teacher gave."""
    folder = Path(path)
    if folder.parent.name.startswith("run_id=") and folder.name[:1] == "v" and folder.name[1:].isdigit():
        return f"{folder.parent.name}/{folder.name}"
    built_in = {cache_dir() / f"{TINY_DIR}-0": "tiny-random", cache_dir() / DEFAULT_DIR: "default"}
    return built_in.get(folder, path) if folder.is_absolute() else path
