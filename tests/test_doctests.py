"""The examples in docstrings are part of the documentation: they must stay true."""

import doctest
import importlib

import pytest

MODULES = ["tasks.lope", "tasks.ladder", "tasks.grpo", "tasks.mcmc", "tasks.evaluate", "tasks.refine",
           "tasks.fewshot", "tasks.gate", "tasks.rewards", "tasks.report"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.failed == 0
