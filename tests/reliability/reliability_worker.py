"""Trains a small dropout classifier with every persistent hook; the kill matrix runs it.

    python reliability_worker.py RUN_DIR TARGET_STEP [--kill POINT:STEP]

Attached: `hooks.checkpoint` (every 5 steps, keep=2), `hooks.evaluate` (every 4 steps),
`hooks.tensorboard` (every 3), `hooks.metrics_log` (CSV, every 2) and `hooks.plot` (points
only, exponential schedule), all under RUN_DIR. It runs `loop.run_to_step(train, TARGET)`,
then writes the final parameters to RUN_DIR/params.npz (no pickle) and `loop.history` to
RUN_DIR/history.json. Rerun in the same RUN_DIR, it resumes.

`--kill POINT:STEP` sends SIGKILL to the process itself at one point (STEP is a global step):

  at-step:S            after every hook of step S (between saves, or before the first one)
  after-save-issued:S  in the first hook of step S+1: the save of step S was copied and
                       handed to the background writer, its write in flight
  in-commit:S          inside Orbax's commit of checkpoint S: written, never made valid
  after-commit:S       right after Orbax's commit (the rename) of checkpoint S returned
  before-delete:S      checkpoint S is about to be deleted by the keep policy: the newer
                       checkpoint that pushed it out is committed, S is still on disk
  in-eval:S            in the middle of the evaluation of step S (its second batch)
  tensorboard-write:S  right after the train scalars of step S went to the TensorBoard
                       writer, before any flush
  metrics-log-write:S  right after the train points of step S were appended to the CSV,
                       before the checkpoint that covers them
  plot-write:S         right after the train points of step S were appended to the plot's
                       points file
  after-run:S          after `run_to_step` returned (S is ignored), before the outputs are
                       written
  sigterm-at-step:S    SIGTERM instead of SIGKILL, after every hook of step S: the run ends
  sigint-at-step:S     there as for Ctrl-C (SIGINT): an end-of-run save, then exit status
                       128 + the signal's number
"""

import argparse
import json
import os
import signal
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np

import loopax
from loopax import hooks

EVERY_CHECKPOINT, EVERY_EVALUATION, EVERY_TENSORBOARD, EVERY_METRICS_LOG = 5, 4, 3, 2
PLOT_START, PLOT_FACTOR = 2, 1.5
KILL_POINTS = (
    "at-step",
    "after-save-issued",
    "in-commit",
    "after-commit",
    "before-delete",
    "in-eval",
    "tensorboard-write",
    "metrics-log-write",
    "plot-write",
    "after-run",
    "sigterm-at-step",
    "sigint-at-step",
)
SIGNALS = {"sigterm-at-step": signal.SIGTERM, "sigint-at-step": signal.SIGINT}


def model_fn(ctx, spec, inputs):
    hidden = nn.relu(nn.Dense(16)(inputs[0]))
    hidden = nn.Dropout(0.3, deterministic=not ctx.training)(hidden)
    return nn.Dense(3)(hidden)


def make_datasets():
    rng = np.random.default_rng(0)
    inputs = rng.normal(size=(72, 4)).astype(np.float32)
    labels = (np.digitize(inputs[:, 0] + inputs[:, 1], [-0.5, 0.5])).astype(np.int32)
    # 48 train examples in batches of 8: a run of 32 steps crosses 5 reshuffled epochs.
    train = loopax.ArrayDataset(
        inputs[:48], labels[:48], batch_size=8, name="train", loop_forever=True, seed=3
    )
    test = loopax.ArrayDataset(
        inputs[48:], labels[48:], batch_size=8, name="test", shuffle=False, drop_remainder=False
    )
    return train, test


def make_trainer():
    return loopax.Trainer(
        model_fn,
        loopax.losses.sparse_categorical_crossentropy_logits,
        loopax.optimizers.adam(0.02),
        train_metrics=[loopax.metrics.MovingAverageSparseCategoricalAccuracy()],
        eval_metrics=[loopax.metrics.SparseCategoricalAccuracy()],
        devices=jax.devices()[:1],
    )


def kill_self():
    os.kill(os.getpid(), signal.SIGKILL)


def patch_commit(step, before):
    """Kills inside (`before`) or right after Orbax's commit of checkpoint `step`."""
    from orbax.checkpoint._src.path import atomicity

    original = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self, *args, **kwargs):
        is_step = os.path.basename(str(self.get_final())) == str(step)
        if is_step and before:
            kill_self()
        result = await original(self, *args, **kwargs)
        if is_step:
            kill_self()
        return result

    atomicity.AtomicRenameTemporaryPath.finalize = finalize


def patch_deletion(step):
    """Kills where Orbax's CheckpointManager is about to delete checkpoint `step` (the keep
    policy), after the commit of the checkpoint that pushed it out."""
    from orbax.checkpoint._src.path import deleter

    original = deleter.StandardCheckpointDeleter.delete_steps

    def delete_steps(self, steps):
        if step in list(steps):
            kill_self()
        return original(self, steps)

    deleter.StandardCheckpointDeleter.delete_steps = delete_steps


def patch_writer(writer, step):
    """Kills right after `writer` was given the train scalars of `step`."""
    original = writer.write_scalars

    def write_scalars(at_step, scalars):
        original(at_step, scalars)
        if at_step == step and "train/loss" in scalars:
            kill_self()

    writer.write_scalars = write_scalars


def patch_evaluation(dataset, trainer, step):
    """Kills in the second batch of the evaluation at global step `step`."""
    original = dataset.yield_batch
    batches = []

    def yield_batch():
        batch = original()
        if trainer.global_step == step:
            batches.append(batch)
            if len(batches) == 2:
                kill_self()
        return batch

    dataset.yield_batch = yield_batch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("target", type=int)
    parser.add_argument("--kill", default=None, help="POINT:STEP, see the module docstring")
    args = parser.parse_args()
    point, step = None, None
    if args.kill is not None:
        point, _, step_text = args.kill.partition(":")
        if point not in KILL_POINTS:
            parser.error(f"unknown kill point {point!r}; the points are {KILL_POINTS}")
        step = int(step_text) if step_text else None
    run_dir = args.run_dir

    if point == "in-commit":
        patch_commit(step, before=True)
    elif point == "after-commit":
        patch_commit(step, before=False)
    elif point == "before-delete":
        patch_deletion(step)
    train, test = make_datasets()
    trainer = make_trainer()
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, run_dir / "ckpt", every_n_steps=EVERY_CHECKPOINT, keep=2)
    print(f"resumed from step {checkpointer.restored_step}", flush=True)
    hooks.evaluate(loop, test, every_n_steps=EVERY_EVALUATION)
    tensorboard = hooks.tensorboard(loop, run_dir / "tb", every_n_steps=EVERY_TENSORBOARD)
    metrics_log = hooks.metrics_log(loop, run_dir / "log.csv", every_n_steps=EVERY_METRICS_LOG)
    plotter = hooks.plot(
        loop, run_dir / "plot", render=False, start_step=PLOT_START, factor=PLOT_FACTOR
    )
    if point == "at-step":
        loop.on_step(
            "kill",
            lambda lp, m: trainer.global_step == step and kill_self(),
            loopax.Priority.UI + 1,
        )
    elif point == "after-save-issued":
        loop.on_step(
            "kill",
            lambda lp, m: trainer.global_step == step + 1 and kill_self(),
            loopax.Priority.VALIDATE - 1,
        )
    elif point in SIGNALS:
        signum = SIGNALS[point]
        loop.on_step(
            "signal",
            lambda lp, m: trainer.global_step == step and os.kill(os.getpid(), signum),
            loopax.Priority.UI + 1,
        )
    elif point == "in-eval":
        patch_evaluation(test, trainer, step)
    elif point == "tensorboard-write":
        patch_writer(tensorboard, step)
    elif point == "metrics-log-write":
        patch_writer(metrics_log, step)
    elif point == "plot-write":
        patch_writer(plotter, step)

    loop.run_to_step(train, args.target)
    if point == "after-run":
        kill_self()
    leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(trainer.params))[0]
    np.savez(run_dir / "params.npz", **{jax.tree_util.keystr(path): leaf for path, leaf in leaves})
    (run_dir / "history.json").write_text(json.dumps(loop.get_state()["history"], sort_keys=True))
    print(f"done at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
