"""loopax._warnings.warn shows the innermost frame outside loopax: the user's line."""

import warnings

from loopax import _warnings


def user_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _warnings.warn("from the user", RuntimeWarning)  # called directly: this line
    return caught


def test_a_direct_call_points_at_the_caller():
    (warning,) = user_line()
    assert warning.filename == __file__
    assert warning.category is RuntimeWarning and str(warning.message) == "from the user"
