"""The run behind the committed format-version-1 checkpoint (`v1_checkpoint/`), shared by
its generator and its test (not a test file).

`python tests/reliability/v1_fixture.py` was run once, on the code of commit 33666b0 (the last
to write checkpoint format version 1), to write `v1_checkpoint/`: the checkpoint of step 8 of
a 20-step run, and `expected.json`, that run's final parameters, train metrics and history.
Running it again on later code writes the later format: the committed files must stay as
they are, since their point is to be what an earlier loopax wrote.
"""

import json
import shutil
import sys
import tempfile
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import optax

import loopax
from loopax import hooks, metrics

FIXTURE = Path(__file__).with_name("v1_checkpoint")
SAVED_STEP = 8
END_STEP = 20


def model_fn(ctx, spec, inputs):
    hidden = nn.Dense(16)(inputs[0])
    hidden = nn.BatchNorm(use_running_average=not ctx.training, axis_name=ctx.axis_name)(hidden)
    hidden = nn.Dropout(0.2, deterministic=not ctx.training)(nn.relu(hidden))
    return nn.Dense(3)(hidden)


def make_trainer():
    return loopax.Trainer(
        model_fn,
        loopax.losses.sparse_categorical_crossentropy_logits,
        optax.adam(1e-2),
        train_metrics=[metrics.MovingAverageSparseCategoricalAccuracy()],
        eval_metrics=[metrics.SparseCategoricalAccuracy()],
        devices=jax.devices()[:1],
        seed=3,
    )


def make_data():
    rng = np.random.default_rng(7)
    inputs = rng.normal(size=(40, 5)).astype(np.float32)
    labels = (inputs[:, 0] > 0).astype(np.int32) + (inputs[:, 1] > 0.5).astype(np.int32)
    return loopax.ArrayDataset(inputs, labels, 8, name="train", loop_forever=True, seed=5)


def run(directory, *, every_n_steps=SAVED_STEP):
    """Trains to `END_STEP` with checkpoints in `directory`; returns `(trainer, loop, metrics)`.

    With checkpoints already in `directory`, the newest is restored and the run continues.
    """
    trainer = make_trainer()
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, directory, every_n_steps=every_n_steps, keep=None)
    hooks.every_n_steps(loop, 3, "read", lambda loop, m: loop.record_train_metrics())
    last = loop.run_to_step(make_data(), END_STEP)
    checkpointer.wait()
    return trainer, loop, {key: float(np.asarray(value)) for key, value in last.items()}


def summary(trainer, loop, last):
    """What an uninterrupted run ends with, as JSON: params, last metrics, history."""
    params = jax.tree_util.tree_flatten_with_path(jax.device_get(trainer.params))[0]
    return {
        "params": {jax.tree_util.keystr(path): np.asarray(leaf).tolist() for path, leaf in params},
        "last_metrics": last,
        "history": {key: loop.history[key] for key in loop.history.keys()},
    }


def main():
    with tempfile.TemporaryDirectory() as tmp:
        trainer, loop, last = run(tmp)
        if FIXTURE.exists():
            shutil.rmtree(FIXTURE)
        shutil.copytree(Path(tmp) / str(SAVED_STEP), FIXTURE / str(SAVED_STEP))
    (FIXTURE / "expected.json").write_text(json.dumps(summary(trainer, loop, last)) + "\n")
    print(f"wrote {FIXTURE} with loopax {loopax.__version__}", file=sys.stderr)


if __name__ == "__main__":
    main()
