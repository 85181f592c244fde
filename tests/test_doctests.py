"""Every `>>>` line in loopax's sources is an example that `pytest --doctest-modules` runs.

pytest collects doctests from the docstrings that `doctest.DocTestFinder` reaches (module,
classes, functions, methods, properties of each module); an example anywhere else (a nested
function, a comment, a string that is not a docstring) would never run, and nothing would
say so. This test fails on such an example, and on a module that cannot be imported.
"""

import doctest
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import loopax

MODULES = sorted(info.name for info in pkgutil.walk_packages(loopax.__path__, "loopax."))


def test_every_module_of_the_package_is_listed():
    # walk_packages must reach the subpackages, or the test below checks nothing there.
    assert {
        "loopax.hooks._checkpointing._checkpointer",
        "loopax.loop._loop",
        "loopax.testing",
    } <= set(MODULES)


def test_the_doctests_run_under_pytest():
    config = (Path(loopax.__file__).parents[1] / "pyproject.toml").read_text()
    assert re.search(r'^testpaths = \[.*"loopax".*\]$', config, re.M)
    assert re.search(r"^addopts = .*--doctest-modules", config, re.M)


@pytest.mark.parametrize("module_name", MODULES)
def test_every_example_in_the_source_is_found(module_name):
    module = importlib.import_module(module_name)
    source = Path(module.__file__).read_text()
    prompts = len(re.findall(r"^\s*>>> ", source, re.M))
    found = sum(len(test.examples) for test in doctest.DocTestFinder().find(module))
    assert found == prompts, (
        f"{module_name} has {prompts} '>>>' lines but doctest finds {found} examples: move "
        "the missing ones into a docstring doctest reaches (module, class, function, method)"
    )
