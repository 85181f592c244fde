"""A run that goes on from an older checkpoint on two processes: the newer ones set aside.

Two real JAX processes joined by `jax.distributed` (2 devices each, gloo) through
`loopax.testing`, forked from the pre-imported interpreter (tests/conftest.py): they train to
10 with checkpoints every 3, restore 6 and train on a different path to 10. Process 0 moves
the old trajectory's 9 and 10 to `<dir>/abandoned/` while process 1 waits for it at a
barrier; both save the new 9 and 10, and a rerun resumes from the new 10.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_checkpoint_multiprocess import _host, _trainer
from test_checkpoint_multiprocess import _shuffled as _data

from loopax.testing import multiprocess

pytestmark = pytest.mark.usefixtures("forked_processes")

TIMEOUT = 180  # for the group of processes; a hang fails, it never waits forever
BARRIER_TIMEOUT = 60.0  # seconds: the processes' own agreement timeout


def restore_older_and_go_on(directory):
    """Both processes: to 10 saving every 3; a new loop restores 6 and goes on to 10 on
    another path (a per-step update shrinks the parameters); a third loop resumes."""
    import warnings

    import jax

    import loopax
    from loopax import hooks

    seed = 100 + jax.process_index()
    options = {"keep": None, "every_n_steps": 3, "barrier_timeout": BARRIER_TIMEOUT}
    result = {}

    first = loopax.Loop(_trainer())
    checkpointer = hooks.checkpoint(first, directory, **options)
    first.run_to_step(_data(seed), 10)
    checkpointer.wait()
    result["first_steps"] = checkpointer.all_steps()
    result["old10"] = _host(first.trainer.params)

    second = loopax.Loop(_trainer())
    checkpointer = hooks.checkpoint(second, directory, **options)  # restores 10
    result["attached_at"] = checkpointer.restored_step
    checkpointer.restore(6)
    second.trainer.add_per_step_update(lambda params: jax.tree.map(lambda a: a * 0.9, params))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second.run_to_step(_data(seed), 10)
        checkpointer.wait()
    result["warnings"] = [str(w.message) for w in caught]
    result["second_steps"] = checkpointer.all_steps()
    result["new10"] = _host(second.trainer.params)

    rerun = loopax.Loop(_trainer())
    checkpointer = hooks.checkpoint(rerun, directory, **options)
    result["rerun"] = [checkpointer.restored_step, _host(rerun.trainer.params)]
    return result


def _leaves(tree):
    import jax

    return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


def test_two_processes_going_on_from_an_older_step_set_the_newer_checkpoints_aside(tmp_path):
    directory = tmp_path / "checkpoints"
    values = multiprocess(2, 2, restore_older_and_go_on, str(directory), timeout=TIMEOUT)
    first, second = values  # both processes returned: neither hung, both exited 0
    for value in values:
        assert value["first_steps"] == [3, 6, 9, 10] and value["attached_at"] == 10
        assert value["second_steps"] == [3, 6, 9, 10]
        # The new trajectory differs from the old one, and the rerun resumes the new one.
        assert not all(
            np.array_equal(a, b)
            for a, b in zip(_leaves(value["old10"]), _leaves(value["new10"]), strict=True)
        )
        assert value["rerun"][0] == 10
        assert value["rerun"][1] == value["new10"]
    assert first["new10"] == second["new10"] and first["old10"] == second["old10"]
    # Process 0 moved the old 9 and 10 aside, once, and said so; process 1 stayed quiet.
    assert sorted(p.name for p in (directory / "abandoned").iterdir()) == ["10", "9"]
    said = [w for w in first["warnings"] if "another trajectory" in w]
    assert len(said) == 1 and "before checkpoints [9, 10]" in said[0], first["warnings"]
    assert not [w for w in second["warnings"] if "another trajectory" in w]
