"""The examples in docstrings are part of the documentation: they must stay true.

Every module of the package whose source holds an example (`>>> `) is collected, so a new example is never
silently left out, and each must actually run at least one (a module whose examples doctest cannot find,
e.g. in a function it does not collect, fails instead of passing with zero)."""

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flows", "models", "storage", "tasks")
MODULES = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts) for pkg in PACKAGES
                 for p in (ROOT / pkg).rglob("*.py") if ">>> " in p.read_text(encoding="utf-8"))


def test_the_examples_are_found():
    """The modules known to document by example are among those collected (the scan works)."""
    known = {"tasks.core.lope", "tasks.strategies.ladder", "tasks.core.advantages", "tasks.core.mcmc", "tasks.core.heldout",
             "tasks.core.fewshot", "tasks.strategies.gate", "tasks.core.answers", "tasks.core.selection",
             "tasks.core.ids", "tasks.core.seeds", "models.scripted"}
    assert known <= set(MODULES), known - set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0, f"{name} has '>>> ' in its source but doctest ran none of its examples"
    assert result.failed == 0
