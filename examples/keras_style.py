"""Digits as a Keras user writes it.

Epochs with validation, checkpoints, a CSV log, early stopping with restore-best, and the learning
rate lowered on plateaus.

    python examples/keras_style.py [--epochs 40] [--dir runs/keras_style]

Each line says which Keras piece it replaces; the README's "Coming from Keras" shows the
Keras program next to it.
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import loopax
from loopax import hooks, losses, metrics, optimizers


def model_fn(ctx, spec, inputs):  # keras.Sequential([Dense(256, "relu"), Dropout(0.2), Dense(10)])
    x = nn.relu(nn.Dense(256)(inputs[0]))
    return nn.Dense(10)(nn.Dropout(0.2, deterministic=not ctx.training)(x))


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--dir", default="runs/keras_style")
    args = parser.parse_args(argv)

    x, y = load_digits(return_X_y=True)
    x_train, x_val, y_train, y_val = train_test_split(
        (x / 16).astype(np.float32), y.astype(np.int32), test_size=0.2, random_state=0
    )
    trainer = loopax.Trainer(  # model.compile(optimizer, loss, metrics)
        model_fn,
        losses.sparse_categorical_crossentropy_logits,
        optimizers.adam(1e-3),
        train_metrics=[metrics.MovingAverageSparseCategoricalAccuracy()],
        eval_metrics=[metrics.SparseCategoricalAccuracy()],
    )
    val = loopax.ArrayDataset(x_val, y_val, 64, name="val", shuffle=False, drop_remainder=False)
    loop = loopax.Loop(trainer)
    hooks.evaluate(loop, val, every_n_epochs=1)  # validation_data=(x_val, y_val)
    hooks.checkpoint(
        loop,
        f"{args.dir}/checkpoints",
        every_n_epochs=1,  # ModelCheckpoint
        best_metric="eval/val/mean_loss",
        restore=False,
    )
    hooks.metrics_log(loop, f"{args.dir}/log.csv", every_n_epochs=1)  # CSVLogger
    hooks.early_stopping(
        loop, "eval/val/mean_loss", patience=5
    )  # EarlyStopping(restore_best_weights=True)
    hooks.reduce_lr_on_plateau(
        loop, "eval/val/mean_loss", factor=0.5, patience=2
    )  # ReduceLROnPlateau
    hooks.progress_bar(loop)  # verbose=1
    # model.fit(epochs=...): epochs in total (run_epochs would run that many more).
    loop.run_to_epoch(loopax.ArrayDataset(x_train, y_train, 64), args.epochs)
    accuracy = trainer.evaluate(val)["Accuracy"]  # model.evaluate(x_val, y_val)
    print(f"stopped after epoch {loop.epoch}; val accuracy: {accuracy:.3f}")
    return accuracy


if __name__ == "__main__":
    main()
