"""Selectors behind one protocol (base.py), and what selection needs beside them: prompt embeddings (embed.py).

One file per selector: kmeans.py (EPS-weighted k-means diverse selection), uniform.py, dapo_filter.py (DAPO
dynamic sampling's first generation batch; `generates`), all.py (the whole active pool; `whole_pool`),
thompson.py (Thompson draws on a pooled Beta pass-rate posterior: tasks/core/passrate.py). Each
implements `Selector` (base.py) and registers itself with `@register`; `SelectConfig.selector`'s choices are
the registered names (tasks/select.py), so the config, the Prefect UI form and `refinery run --set` list
exactly these.

Adding a selector is one file, registered without a line anywhere else, in either of two ways:
- inside the project: a module in this folder (every module here is imported below);
- outside it (a user's own package, or a test): name its importable module in the environment variable
  `REFINERY_SELECTORS` (comma-separated module names), which is imported here right after this folder's
  modules, in every process that reads a config. tests/test_selector_registry.py adds one that way.
The registry must be complete before tasks/select.py builds the config's choices from it; a selector
registered later is refused by the config like any unknown name.
"""

from __future__ import annotations

import importlib
import os
import pkgutil

from tasks.selectors.base import REGISTRY, Candidates, Picks, RoundView, Selector, pick_rows, register, selector

ENV = "REFINERY_SELECTORS"

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
for _name in filter(None, (n.strip() for n in os.environ.get(ENV, "").split(","))):
    try:
        importlib.import_module(_name)
    except ImportError as e:
        raise ImportError(f"{ENV} names the selector module {_name!r}, which cannot be imported: {e}") from None

__all__ = ["ENV", "REGISTRY", "Candidates", "Picks", "RoundView", "Selector", "pick_rows", "register", "selector"]
