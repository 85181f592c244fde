"""Train a small dropout MLP on scikit-learn's bundled digits with every loopax hook.

    python examples/digits.py                    # ~98% test accuracy in well under a minute
    python examples/digits.py --dir runs/digits  # run again with the same --dir: it resumes
    python examples/digits.py --devices 4        # data-parallel on 4 simulated CPU devices
    python examples/digits.py --model nnx        # Flax NNX's MNIST CNN instead of the MLP
    python examples/digits.py --steps-per-execution 16  # 16 steps fused in a dispatch

Attached: progress bar, Orbax checkpoints (resume on restart, the best by validation loss
kept), evaluation of a validation and the test split every 100 steps, early stopping on the
validation loss (the best parameters restored at the end), the learning rate halved on a
plateau, TensorBoard, a CSV log, plots, throughput (steps/s, examples/s, FLOPs), and a report
at the end. The Trainer keeps an exponential moving average of the parameters
(`ema_decay`), which every evaluation and the report use. The data are put on the devices
once (`ArrayDataset(on_device=True)`): each step is one program call that reads
its own batch there and each evaluation batch is read there too, so nothing is copied from
the host, as an accelerator needs, and the numbers are those of host batches. The last line
printed is `test accuracy: 0.9xx`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

STARTED = time.perf_counter()  # the process's start, for the time to its first step


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="global step to train to")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--devices", type=int, default=1, help="devices to split each batch over")
    parser.add_argument("--optimizer", default="adam", help="sgd, adam, adamw or rmsprop")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument(
        "--steps-per-execution",
        type=int,
        default=1,
        help="steps fused into one dispatch (1: one program call a step)",
    )
    parser.add_argument("--dir", default="runs/digits", help="checkpoints, logs and plots")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--ema-decay",
        type=float,
        default=0.99,
        help="decay of the parameters' moving average, which evaluations use (0: none)",
    )
    parser.add_argument(
        "--accumulate-steps", type=int, default=1, help="micro-batches per optimizer step"
    )
    parser.add_argument(
        "--compute-dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="the dtype the model computes in (parameters stay float32)",
    )
    parser.add_argument(
        "--model",
        choices=("mlp", "nnx"),
        default="mlp",
        help="mlp: a model function (Linen layers); nnx: a flax.nnx CNN module",
    )
    return parser.parse_args(argv)


def read_digits():
    """The 1797 digits bundled with scikit-learn: (pixels 0..16 as float64 [1797, 64], labels).

    Read from scikit-learn's own data file, as `sklearn.datasets.load_digits` reads it,
    without importing scikit-learn (which takes longer than a resumed run needs to start).
    """
    import importlib.util
    from pathlib import Path

    import numpy as np

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the digits come with scikit-learn: pip install scikit-learn")
    path = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():  # a scikit-learn that keeps them elsewhere
        from sklearn.datasets import load_digits as sklearn_digits

        data = sklearn_digits()
        return data.data, data.target
    table = np.loadtxt(path, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int)


def load_digits(seed: int):
    """The 1797 8x8 digits bundled with scikit-learn (no download), split 80/20."""
    import numpy as np

    pixels, target = read_digits()
    images = (pixels / 16.0).astype(np.float32)
    labels = target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(labels))
    split = int(0.8 * len(labels))
    train, test = order[:split], order[split:]
    return (images[train], labels[train]), (images[test], labels[test])


def hold_out(inputs, labels, fraction: float):
    """Splits off the last `fraction` of the examples (already shuffled) for validation."""
    split = int(round(len(labels) * (1 - fraction)))
    return (inputs[:split], labels[:split]), (inputs[split:], labels[split:])


def model_fn(ctx, spec, inputs):
    """An MLP with dropout: 64 -> 256 -> 128 -> 10 logits."""
    import flax.linen as nn

    x = inputs[0]
    for width in (256, 128):
        x = nn.relu(nn.Dense(width)(x))
        x = nn.Dropout(0.2, deterministic=not ctx.training)(x)
    return nn.Dense(10)(x)


def nnx_cnn(seed: int):
    """Flax NNX's MNIST CNN (its documented example), sized for 8x8 digits.

    Two convolutions with BatchNorm and dropout, average pooling, two linear layers.
    """
    from functools import partial

    from flax import nnx

    class CNN(nnx.Module):
        def __init__(self, *, rngs: nnx.Rngs):
            self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
            self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
            self.dropout1 = nnx.Dropout(rate=0.025, rngs=rngs)
            self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
            self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
            self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
            self.linear1 = nnx.Linear(2 * 2 * 64, 256, rngs=rngs)
            self.dropout2 = nnx.Dropout(rate=0.025, rngs=rngs)
            self.linear2 = nnx.Linear(256, 10, rngs=rngs)

        def __call__(self, x):
            x = x.reshape(x.shape[0], 8, 8, 1)  # the flat 64 pixels as an image
            x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x)))))
            x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
            x = x.reshape(x.shape[0], -1)
            x = nnx.relu(self.dropout2(self.linear1(x)))
            return self.linear2(x)

    return CNN(rngs=nnx.Rngs(seed))


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    if args.devices > 1:
        # Simulated CPU devices must be requested before JAX initializes.
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}"

    import jax

    import loopax
    from loopax import hooks, losses, metrics, optimizers

    if len(jax.devices()) < args.devices:
        sys.exit(f"asked for {args.devices} devices but JAX has {len(jax.devices())}")
    devices = jax.devices()[: args.devices]
    (train_x, train_y), (test_x, test_y) = load_digits(args.seed)
    (train_x, train_y), (val_x, val_y) = hold_out(train_x, train_y, 0.15)
    # Every split goes to the Trainer's devices once, and each step or evaluation batch reads
    # its rows there: no copy from the host (on an accelerator each is a transfer and a wait),
    # the same batches as host arrays give. Fused steps (--steps-per-execution) give the same
    # numbers, but today compile a program per power-of-two group size (groups end where
    # hooks fire), which costs this short job more at its start than it saves; and the CNN's
    # gradient convolutions inside their loop are ten times slower on XLA:CPU (which
    # rewrites them into its fast form only outside loops) and round otherwise.
    on_device = {"on_device": True, "devices": devices}
    train = loopax.ArrayDataset(
        train_x,
        train_y,
        args.batch_size,
        name="train",
        seed=args.seed,
        loop_forever=True,
        **on_device,
    )
    # Evaluation datasets must end, and count every example: drop_remainder=False.
    ordered = {"shuffle": False, "drop_remainder": False, **on_device}
    train_eval = loopax.ArrayDataset(train_x, train_y, args.batch_size, name="train", **ordered)
    val = loopax.ArrayDataset(val_x, val_y, args.batch_size, name="val", **ordered)
    test = loopax.ArrayDataset(test_x, test_y, args.batch_size, name="test", **ordered)
    trainer = loopax.Trainer(
        model_fn if args.model == "mlp" else nnx_cnn(args.seed),
        losses.sparse_categorical_crossentropy_logits,
        optimizers.from_name(args.optimizer, learning_rate=args.learning_rate),
        train_metrics=[metrics.MovingAverageSparseCategoricalAccuracy()],
        eval_metrics=[metrics.SparseCategoricalAccuracy()],
        seed=args.seed,
        devices=devices,
        accumulate_steps=args.accumulate_steps,
        compute_dtype=None if args.compute_dtype == "float32" else args.compute_dtype,
        loss_scale="dynamic" if args.compute_dtype == "float16" else None,
        ema_decay=args.ema_decay or None,  # evaluations use the average of the parameters
    )
    loop = loopax.Loop(trainer, steps_per_execution=args.steps_per_execution)
    compiling = []  # seconds each program took to compile (near 0 when JAX's cache had it)
    trainer.on_exec_creation(lambda info: compiling.append(info.compile_seconds))
    hooks.first_n_steps(
        loop,
        1,
        "time to first step",
        lambda loop, metrics: print(
            f"first step {time.perf_counter() - STARTED:.2f} s after start "
            f"({sum(compiling):.2f} s of it compiling)"
        ),
        of_process=True,
    )
    checkpointer = hooks.checkpoint(
        loop,
        os.path.join(args.dir, "checkpoints"),
        every_n_steps=100,  # at every evaluation: the best step is kept on disk, so early
        best_metric="eval/val/mean_loss",  # stopping restores it in a rerun too
    )
    if trainer.global_step > 0:
        print(f"resumed from step {trainer.global_step} in {args.dir}")
    if not args.no_progress:
        hooks.progress_bar(loop)
    hooks.evaluate(loop, [val, test], every_n_steps=100)
    hooks.early_stopping(loop, "eval/val/mean_loss", patience=5)
    hooks.reduce_lr_on_plateau(loop, "eval/val/mean_loss", factor=0.5, patience=2)
    hooks.tensorboard(loop, os.path.join(args.dir, "tensorboard"))
    hooks.metrics_log(loop, os.path.join(args.dir, "metrics.csv"))
    hooks.plot(loop, os.path.join(args.dir, "plots"))
    hooks.throughput(loop, every_n_steps=100)  # into TensorBoard, the CSV log and history
    loop.run_to_step(train, args.steps)  # early stopping prints its line if it stops
    checkpointer.wait()
    if "train/examples_per_second" in loop.history.keys():  # none in a run too short to time
        print(f"throughput: {loop.history['train/examples_per_second'][-1][1]:,.0f} examples/s")
    hooks.report_eval(trainer, train_eval, val, test)
    accuracy = trainer.evaluate(test)["Accuracy"]
    print(f"test accuracy: {accuracy:.3f}")
    return accuracy


if __name__ == "__main__":
    main()
