"""The `>>>` examples in loopax.trainer's docstrings run and pass."""

import doctest
import importlib

import pytest

MODULES = ["_context", "_datasets", "_executors", "_hooks", "_inflight", "_loop", "_state",
           "_steps", "_trainer"]


WITH_EXAMPLES = {"_datasets", "_hooks", "_loop", "_trainer"}


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples(module_name):
    module = importlib.import_module(f"loopax.trainer.{module_name}")
    results = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert results.failed == 0
    if module_name in WITH_EXAMPLES:
        assert results.attempted > 0
