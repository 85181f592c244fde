"""The public surface of loopax.metrics: exports and formatting helpers (the doctests of its
modules run under `--doctest-modules`)."""

import pytest

from loopax import metrics


def test_all_is_sorted_and_exported():
    assert metrics.__all__ == sorted(metrics.__all__)
    for name in metrics.__all__:
        assert getattr(metrics, name) is not None


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
