"""Policy backends, checkpoints and memory handling. Importing the package caps oneDNN's and ideep's
primitive caches (models/memory.py bound_onednn_cache) before any model code runs a kernel."""

from models.memory import bound_onednn_cache

bound_onednn_cache()
