"""Runs the doctest examples of every loopax.optimizers module."""

import doctest
import importlib

import pytest

_MODULES = [
    "loopax.optimizers._learning_rate",
    "loopax.optimizers._optimizers",
    "loopax.optimizers._schedules",
]


@pytest.mark.parametrize("module_name", _MODULES)
def test_doctests_pass(module_name):
    results = doctest.testmod(importlib.import_module(module_name))
    assert results.attempted > 0
    assert results.failed == 0
