"""Trains the reliability dropout classifier with fused steps; test_fused_kill runs it.

    python fused_worker.py RUN_DIR TARGET_STEP STEPS_PER_EXECUTION [--kill POINT:STEP]
                           [--on-device]

Attached: `hooks.checkpoint` (every 48 steps, keep=2) and `hooks.metrics_log` (CSV, every
40 steps) under RUN_DIR, so groups of up to 32 steps run between them. It runs
`loop.run_to_step(train, TARGET)` with `Loop(trainer, steps_per_execution=K)`, then writes
the final parameters to RUN_DIR/params.npz and `loop.history` to RUN_DIR/history.json.
Rerun in the same RUN_DIR (with any K), it resumes.

`--kill POINT:STEP` sends SIGKILL to the process itself (STEP is a global step):

  group-end:S  after the hooks of the first group that ends at or past global step S
  mid-group:S  while the batches of a group are read, at the batch of global step S + 1
               (the group's earlier batches read, none of it run)

With `--on-device` the train data is the same `ArrayDataset` with `on_device=True`: the
fused steps take their batches from the device arrays themselves, and `mid-group:S` kills
once the loop has moved the dataset past a group that reaches beyond step S, before the
group runs.
"""

import argparse
import json
import os
import signal
from pathlib import Path

import jax
import numpy as np
import optax
from reliability_worker import make_datasets, model_fn

import loopax
from loopax import hooks

EVERY_CHECKPOINT, EVERY_METRICS_LOG = 48, 40


def make_trainer():
    # optax.adam, not loopax.optimizers.adam: an optimizer holding its learning rate in its
    # state is not bit-identical when fused (tests/trainer/test_fused.py, an xfail).
    return loopax.Trainer(
        model_fn,
        loopax.losses.sparse_categorical_crossentropy_logits,
        optax.adam(0.02),
        train_metrics=[loopax.metrics.MovingAverageSparseCategoricalAccuracy()],
        devices=jax.devices()[:1],
    )


def kill_self():
    os.kill(os.getpid(), signal.SIGKILL)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("target", type=int)
    parser.add_argument("steps_per_execution", type=int)
    parser.add_argument("--kill", default=None, help="POINT:STEP, see the module docstring")
    parser.add_argument("--on-device", action="store_true", help="on-device train data")
    args = parser.parse_args()
    run_dir = args.run_dir

    train, _ = make_datasets()
    if args.on_device:
        train = loopax.ArrayDataset(
            train.inputs,
            train.labels,
            batch_size=train.batch_size,
            name=train.name,
            loop_forever=True,
            seed=train.seed,
            on_device=True,
            devices=jax.devices()[:1],
        )
    trainer = make_trainer()
    loop = loopax.Loop(trainer, steps_per_execution=args.steps_per_execution)
    checkpointer = hooks.checkpoint(loop, run_dir / "ckpt", every_n_steps=EVERY_CHECKPOINT, keep=2)
    print(f"resumed from step {checkpointer.restored_step}", flush=True)
    hooks.metrics_log(loop, run_dir / "log.csv", every_n_steps=EVERY_METRICS_LOG)
    groups = []
    loop.on_step("group", lambda lp, m: groups.append(len(lp.group_metrics["loss"])))
    if args.kill is not None:
        point, _, step_text = args.kill.partition(":")
        step = int(step_text)
        if point == "group-end":
            loop.on_step(
                "kill",
                lambda lp, m: trainer.global_step >= step and kill_self(),
                loopax.Priority.UI + 1,
            )
        elif point == "mid-group" and args.on_device:
            device_steps = train.device_steps

            def read_group(count):
                chunks = device_steps(count)
                if trainer.global_step + count > step + 1:
                    kill_self()  # the dataset has moved past the group; none of it ran
                return chunks

            train.device_steps = read_group
        elif point == "mid-group":
            original = train.yield_batch
            read = []

            def yield_batch():
                batch = original()
                read.append(None)
                if trainer.global_step + len(read) > step and len(read) > 1:
                    kill_self()
                return batch

            loop.on_step("reads", lambda lp, m: read.clear())
            train.yield_batch = yield_batch
            # The loop reads a group through yield_batches when a dataset has it (one
            # stacked read); without it, batch by batch, so the kill falls inside a group.
            train.yield_batches = None
        else:
            parser.error(f"unknown kill point {point!r}")

    loop.run_to_step(train, args.target)
    leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(trainer.params))[0]
    np.savez(run_dir / "params.npz", **{jax.tree_util.keystr(path): leaf for path, leaf in leaves})
    (run_dir / "history.json").write_text(json.dumps(loop.get_state()["history"], sort_keys=True))
    print(f"done at step {trainer.global_step}, longest group {max(groups)}", flush=True)


if __name__ == "__main__":
    main()
