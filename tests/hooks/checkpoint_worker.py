"""Trains a tiny dropout model with checkpoints; the kill-and-resume tests run it as a subprocess.

    python checkpoint_worker.py DIR TARGET_STEP OUT.npz [--every N] [--kill-after-save STEP]
                                [--kill-in-commit STEP] [--exit-after-save STEP]
                                [--signal-at STEP --signal INT|TERM] [--second-signal-in-commit]
                                [--no-checkpoint] [--nnx]

`--kill-after-save S` sends SIGKILL to itself right after the save of global step S was issued
(its background write still in flight: saves are handed to the writer thread once the hooks
of their step have run, so the kill comes in the next step's first hook); `--kill-in-commit S`
does it inside Orbax's commit of step S, after the data was written but before the checkpoint
became valid; `--exit-after-save S` leaves the interpreter normally right after issuing the
save of step S. `--signal-at K` sends the process SIGINT (or `--signal TERM`) from a hook at loop
step K, as a user pressing Ctrl-C or a preemption would; with `--second-signal-in-commit` the
same signal comes again inside Orbax's commit of the save that follows. Without those it
runs to TARGET_STEP and writes the final parameters to OUT.npz (no pickle).
"""

import argparse
import os
import signal
import threading

import flax.linen as nn
import jax
import numpy as np
import optax

import loopax
from loopax import hooks


def model_fn(ctx, spec, inputs):
    hidden = nn.relu(nn.Dense(16)(inputs[0]))
    hidden = nn.Dropout(0.5, deterministic=not ctx.training)(hidden)
    return nn.Dense(1)(hidden)


def nnx_model():
    """The same network as an NNX module, with BatchNorm too."""
    from flax import nnx  # noqa: PLC0415

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(4, 16, rngs=rngs)
            self.norm = nnx.BatchNorm(16, rngs=rngs)
            self.dropout = nnx.Dropout(0.5, rngs=rngs)
            self.out = nnx.Linear(16, 1, rngs=rngs)

        def __call__(self, x):
            return self.out(self.dropout(nnx.relu(self.norm(self.hidden(x)))))

    return Model(nnx.Rngs(0))


def make_dataset():
    rng = np.random.default_rng(0)
    inputs = rng.normal(size=(40, 4)).astype(np.float32)
    labels = (inputs.sum(axis=1, keepdims=True) > 0).astype(np.float32)
    # 40 examples in batches of 8: the run crosses several reshuffled epochs.
    return loopax.ArrayDataset(inputs, labels, batch_size=8, loop_forever=True, seed=3)


def kill_self():
    os.kill(os.getpid(), signal.SIGKILL)


def inside_commit(action, step=None):
    """Runs `action()` inside Orbax's commit of checkpoint `step` (of any, with None)."""
    from orbax.checkpoint._src.path import atomicity  # noqa: PLC0415

    original = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self, *args, **kwargs):
        if step is None or os.path.basename(str(self.get_final())) == str(step):
            action()
        return await original(self, *args, **kwargs)

    atomicity.AtomicRenameTemporaryPath.finalize = finalize


def signal_then_hang(signum):
    """The signal comes again while the commit hangs (a slow disk): the commit never ends."""
    os.kill(os.getpid(), signum)
    threading.Event().wait()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("target", type=int)
    parser.add_argument("out")
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--kill-after-save", type=int)
    parser.add_argument("--kill-in-commit", type=int)
    parser.add_argument("--exit-after-save", type=int)
    parser.add_argument("--signal-at", type=int)
    parser.add_argument("--signal", choices=["INT", "TERM"], default="INT")
    parser.add_argument("--second-signal-in-commit", action="store_true")
    parser.add_argument("--no-checkpoint", action="store_true")
    parser.add_argument("--nnx", action="store_true", help="train an NNX module")
    args = parser.parse_args()

    if args.kill_in_commit is not None:
        inside_commit(kill_self, args.kill_in_commit)
    trainer = loopax.Trainer(
        nnx_model() if args.nnx else model_fn,
        loopax.losses.binary_crossentropy_logits,
        optax.adam(0.01),
        devices=jax.devices()[:1],
    )
    loop = loopax.Loop(trainer)
    if not args.no_checkpoint:
        checkpointer = hooks.checkpoint(loop, args.directory, every_n_steps=args.every, keep=2)
        print(f"resumed from step {checkpointer.restored_step}", flush=True)
    if args.signal_at is not None:
        signum = getattr(signal, f"SIG{args.signal}")

        def send_signal(loop, metrics):
            if loop.loop_step == args.signal_at:
                os.kill(os.getpid(), signum)
                if args.second_signal_in_commit:
                    # The save that follows is the end-of-run one, of the next global step.
                    inside_commit(lambda: signal_then_hang(signum), args.signal_at + 1)

        loop.on_step("signal", send_signal)
    if args.kill_after_save is not None:

        def kill_after_save(loop, metrics):
            if trainer.global_step == args.kill_after_save + 1:
                kill_self()

        loop.on_step("kill", kill_after_save, loopax.Priority.VALIDATE)
    if args.exit_after_save is not None:

        def exit_after_save(loop, metrics):
            if trainer.global_step == args.exit_after_save + 1:
                raise SystemExit(3)  # not an Exception: leaves the loop and the interpreter

        loop.on_step("exit", exit_after_save, loopax.Priority.VALIDATE)
    loop.run_to_step(make_dataset(), args.target)
    leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(trainer.params))[0]
    np.savez(args.out, **{jax.tree_util.keystr(path): leaf for path, leaf in leaves})
    print(f"done at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
