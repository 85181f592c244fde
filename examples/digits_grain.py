"""The digits task of examples/digits.py, fed by grain pipelines instead of ArrayDataset.

    pip install -e ".[examples,grain]"
    python examples/digits_grain.py                          # ~97% test accuracy
    python examples/digits_grain.py --dir runs/digits_grain  # run again: it resumes exactly

The training data is a grain MapDataset (shuffled from a seed, reshuffled every epoch,
batched, repeated) passed to the Loop as it is; the test set is a grain MapDataset wrapped in
`loopax.IterableDataset` to give its evaluations a name. The checkpoint saves the grain
iterator's position with the model, so a rerun with the same --dir continues with exactly the
batches an uninterrupted run would have seen. The last line printed is `test accuracy: 0.9xx`.
"""

from __future__ import annotations

import argparse
import os

from digits import load_digits, model_fn


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="global step to train to")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--dir", default="runs/digits_grain", help="checkpoints")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def records(inputs, labels) -> list[dict]:
    """One grain record per example.

    Batching stacks them into {"inputs", "labels"} arrays, a form loopax reads as it is.
    """
    return [{"inputs": image, "labels": label} for image, label in zip(inputs, labels, strict=True)]


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)

    import grain
    import jax

    import loopax
    from loopax import hooks, losses, metrics, optimizers

    (train_x, train_y), (test_x, test_y) = load_digits(args.seed)
    train = (
        grain.MapDataset.source(records(train_x, train_y))
        .shuffle(seed=args.seed)  # a new order every epoch, from the seed
        .batch(args.batch_size, drop_remainder=True)  # one shape: one compiled step
        .repeat()
    )
    test = loopax.IterableDataset(
        grain.MapDataset.source(records(test_x, test_y)).batch(args.batch_size), name="test"
    )
    trainer = loopax.Trainer(
        model_fn,
        losses.sparse_categorical_crossentropy_logits,
        optimizers.adam(learning_rate=1e-3),
        train_metrics=[metrics.MovingAverageSparseCategoricalAccuracy()],
        eval_metrics=[metrics.SparseCategoricalAccuracy()],
        seed=args.seed,
        devices=jax.devices()[:1],
    )
    loop = loopax.Loop(trainer)
    checkpointer = hooks.checkpoint(loop, os.path.join(args.dir, "checkpoints"), every_n_steps=200)
    if trainer.global_step > 0:
        print(f"resumed from step {trainer.global_step} in {args.dir}")
    hooks.evaluate(loop, test, every_n_steps=200, print_results=True)
    loop.run_to_step(train, args.steps)  # the grain dataset itself: loopax reads it
    checkpointer.wait()
    accuracy = trainer.evaluate(test)["Accuracy"]
    print(f"test accuracy: {accuracy:.3f}")
    return accuracy


if __name__ == "__main__":
    main()
