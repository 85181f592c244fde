"""The `>>>` examples in loopax.trainer's docstrings run and pass."""

import doctest
import importlib
import pkgutil

import pytest

import loopax.trainer

MODULES = sorted(info.name for info in pkgutil.iter_modules(loopax.trainer.__path__))
WITH_EXAMPLES = {"_datasets", "_history", "_hooks", "_loop", "_trainer"}


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples(module_name):
    module = importlib.import_module(f"loopax.trainer.{module_name}")
    results = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert results.failed == 0
    if module_name in WITH_EXAMPLES:
        assert results.attempted > 0
