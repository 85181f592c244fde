"""The public surface of loopax.metrics: exports, formatting helpers, doctests."""

import doctest
import importlib

import pytest

from loopax import metrics


def test_all_is_sorted_and_exported():
    assert metrics.__all__ == sorted(metrics.__all__)
    for name in metrics.__all__:
        assert getattr(metrics, name) is not None


@pytest.mark.parametrize(
    "module", ["loopax.metrics._base", "loopax.metrics._mean", "loopax.metrics._accuracy"]
)
def test_doctests_pass(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0
    assert result.failed == 0


@pytest.mark.parametrize(
    "value, text",
    [
        (0.123456, "0.123"),
        (1234.5, "1.23e+03"),
        (2.0, "2"),
        (float("nan"), "nan"),
        (float("inf"), "inf"),
    ],
)
def test_format_number(value, text):
    assert metrics.format_number(value) == text


@pytest.mark.parametrize("value, text", [(0.93412, "93.41%"), (1.0, "100.00%"), (0.0, "0.00%")])
def test_format_percent(value, text):
    assert metrics.format_percent(value) == text
