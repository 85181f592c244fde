"""A clean program prints nothing of Orbax's: no notes on reading, no traceback at exit."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys, tempfile
    import flax.linen as nn
    import numpy as np
    import loopax
    from loopax import hooks

    def new_loop():
        trainer = loopax.Trainer(lambda ctx, spec, inputs: nn.Dense(1)(inputs[0]),
                                 loopax.losses.mean_squared_error, loopax.optimizers.sgd(0.1))
        return loopax.Loop(trainer)

    saved = tempfile.mkdtemp()
    loop = new_loop()
    hooks.checkpoint(loop, saved, every_n_steps=2)
    x = np.ones((8, 2), np.float32)
    loop.run_steps(loopax.ArrayDataset(x, x[:, :1], 4, loop_forever=True), 4)
    loopax.load_params(saved)
    loopax.load_params(saved, step=2)
    hooks.checkpoint(new_loop(), tempfile.mkdtemp(), every_n_steps=2)  # then exit, no save
    print("DONE")
""")


def test_reading_checkpoints_and_exiting_before_a_save_print_nothing_else():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "DONE"
    assert done.stderr == "", done.stderr
