"""Damaged checkpoints, with real Orbax checkpoints on disk: each kind of damage is named in a
warning, the damaged checkpoint is moved to `<dir>/damaged/` (never deleted), the previous
good one is restored and training goes on from it; when none is good, the hook refuses to
start over."""

import contextlib
import json
import re
import shutil

import numpy as np
import pytest
from reliability_helpers import (
    array_data_files,
    assert_restores,
    assert_trees_equal,
    files_under,
    flip_bytes,
    make_data,
    make_trainer,
    train_with_checkpoints,
)

import loopax
from loopax import hooks


def forge_nan_checkpoint(directory, states):
    """Replaces checkpoint 4 by one as a loopax without the finite check could have written:
    valid Orbax files, valid checksums, NaN parameters."""
    import orbax.checkpoint as ocp

    from loopax.hooks._checkpointing._io import checksums

    bundle = json.loads((directory / "4" / "loopax" / "metadata").read_text())
    shutil.rmtree(directory / "4")
    state = {**states[4], "params": {**states[4]["params"]}}
    state["params"]["Dense_0"] = {**state["params"]["Dense_0"]}
    kernel = state["params"]["Dense_0"]["kernel"]
    state["params"]["Dense_0"]["kernel"] = np.full_like(kernel, np.nan)
    bundle["checksums"] = checksums(state)
    handlers = {"state": ocp.StandardCheckpointHandler(), "loopax": ocp.JsonCheckpointHandler()}
    with ocp.CheckpointManager(directory, item_handlers=handlers) as manager:
        manager.save(
            4,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), loopax=ocp.args.JsonSave(bundle)
            ),
            force=True,
        )
        manager.wait_until_finished()


def replace_arrays(checkpoint, other):
    shutil.rmtree(checkpoint / "state")
    shutil.copytree(other / "state", checkpoint / "state")


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# kind -> (how checkpoint 4 is damaged, what the warning says about why)
DAMAGE = {
    # The arrays are Zstandard-compressed: flipped bytes make their decompression fail, or
    # decompress to other bytes, which the checksums loopax wrote catch (which one happens
    # depends on where the bytes land).
    "flipped bytes in the array data files": (
        lambda directory, states: [flip_bytes(path) for path in array_data_files(directory / "4")],
        r"DamagedCheckpointError: array '[\w/]+' does not match the checksum written with it"
        r"|ZSTD_decompressStream\(\) failed: Data corruption detected",
    ),
    # Valid files holding other arrays (a stale copy, a mixed-up restore from backup): only
    # loopax's own checksums can tell.
    "array files of another step": (
        lambda directory, states: replace_arrays(directory / "4", directory / "2"),
        r"DamagedCheckpointError: array '[\w/]+' does not match the checksum written with it "
        r"\(saved [0-9a-f]{8}, read [0-9a-f]{8}\)",
    ),
    "truncated array data files": (
        lambda directory, states: [truncate(path) for path in array_data_files(directory / "4")],
        r'OUT_OF_RANGE: Error reading "[\w.]+/.*not valid for value of size',
    ),
    # Tensorstore reads a missing data file as empty: "Truncated Zstd-compressed stream".
    "deleted array data files": (
        lambda directory, states: [path.unlink() for path in array_data_files(directory / "4")],
        r'Error reading "[\w.]+/.*(Truncated Zstd-compressed stream|NOT_FOUND)',
    ),
    "corrupted JSON description": (
        lambda directory, states: (directory / "4" / "loopax" / "metadata").write_text('{"form'),
        r"JSONDecodeError: ",
    ),
    "NaN parameters with valid checksums": (
        forge_nan_checkpoint,
        r"array 'params/Dense_0/kernel' holds NaN or infinite values",
    ),
    "missing state item": (
        lambda directory, states: shutil.rmtree(directory / "4" / "state"),
        r"KeyError: .*Unknown key: state",
    ),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_previous_one_restored(tmp_path, kind):
    damage, why = DAMAGE[kind]
    directory = tmp_path / "ckpt"
    states = train_with_checkpoints(make_trainer(), directory, 4)
    assert sorted(p.name for p in directory.iterdir()) == ["2", "4"]
    damage(directory, states)
    damaged_files = files_under(directory / "4")

    trainer = make_trainer()
    loop = loopax.Loop(trainer)
    with pytest.warns(RuntimeWarning) as caught:
        checkpointer = hooks.checkpoint(loop, directory)
    messages = [str(w.message) for w in caught if "is damaged" in str(w.message)]
    assert len(messages) == 1, [str(w.message) for w in caught]
    # It names the checkpoint, why, and where it went.
    assert re.search(
        rf"checkpoint '{re.escape(str(directory / '4'))}' is damaged \(.*{why}",
        messages[0],
        re.DOTALL,
    ), messages[0]
    assert f"moved to '{directory / 'damaged' / '4'}'" in messages[0]
    # Never deleted: moved aside as it was.
    assert files_under(directory / "damaged" / "4") == damaged_files
    assert not (directory / "4").exists()
    # The previous good checkpoint, exactly as it was saved.
    assert checkpointer.restored_step == 2
    assert (trainer.global_step, loop.loop_step) == (2, 2)
    assert_trees_equal(states[2], trainer.state_dict())

    # Training goes on from it, to the same parameters as the run that saved it.
    loop.run_to_step(make_data(), 4)
    checkpointer.wait()
    assert checkpointer.all_steps() == [2, 4]
    assert_trees_equal(states[4]["params"], trainer.params)
    assert_trees_equal(states[4]["opt_state"], trainer.state_dict()["opt_state"])
    # The directory, damaged/ included, stays usable.
    assert_restores(directory, 4, trainer.state_dict())


def test_when_every_checkpoint_is_damaged_the_hook_refuses_to_start_over(tmp_path):
    directory = tmp_path / "ckpt"
    train_with_checkpoints(make_trainer(), directory, 4)
    for path in array_data_files(directory / "2"):
        flip_bytes(path)
    (directory / "4" / "loopax" / "metadata").write_text("{")

    for attempt in range(2):  # set aside at the first attach: the second one refuses too
        trainer = make_trainer()
        with (
            pytest.warns(RuntimeWarning, match="is damaged")
            if attempt == 0
            else contextlib.nullcontext()
        ):
            with pytest.raises(hooks.NoGoodCheckpointError) as raised:
                hooks.checkpoint(loopax.Loop(trainer), directory)
        message = str(raised.value)
        assert f"no good checkpoint in '{directory}'" in message
        assert f"moved to '{directory / 'damaged'}' (2, 4)" in message
        assert "restore='never' or use a new directory" in message
        assert trainer.global_step == 0  # nothing was loaded
    assert sorted(p.name for p in (directory / "damaged").iterdir()) == ["2", "4"]

    # The way out it names: start fresh beside the damaged ones, which stay.
    trainer = make_trainer()
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, directory, restore="never")
    assert checkpointer.restored_step is None and trainer.global_step == 0
    loop.run_to_step(make_data(), 2)
    checkpointer.wait()
    assert checkpointer.all_steps() == [2]
    assert sorted(p.name for p in (directory / "damaged").iterdir()) == ["2", "4"]
    assert_restores(directory, 2, trainer.state_dict())
