"""One process of a multi-process run (tests/trainer/test_multiprocess.py starts it).

Usage: python multiprocess_worker.py PORT NUM_PROCESSES PROCESS_ID OUT_FILE
With NUM_PROCESSES == 0 it runs alone on one device, as the reference.

Everything happens in `main()`: pytest imports this file when collecting doctests, and
that import must neither read the command line nor touch jax's device settings.
"""

import os
import sys

GLOBAL_BATCH = 16


def model_fn(ctx, spec, inputs):
    import flax.linen as nn

    return nn.Dense(1)(nn.tanh(nn.Dense(8)(inputs[0])))


def batches():
    import numpy as np

    rng = np.random.default_rng(0)
    for _ in range(5):
        x = rng.normal(size=(GLOBAL_BATCH, 3)).astype(np.float32)
        yield x, x.sum(axis=1, keepdims=True)


def local_share(num_processes, process_id):
    # Each process yields its own rows of every global batch.
    share = GLOBAL_BATCH // max(num_processes, 1)
    start = process_id * share
    for x, y in batches():
        yield [x[start : start + share]], [y[start : start + share]]


def main():
    port, num_processes, process_id, out_file = sys.argv[1:5]
    num_processes, process_id = int(num_processes), int(process_id)
    # Before jax is imported: two simulated CPU devices per process.
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax

    if num_processes:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes, process_id)

    import numpy as np
    import optax

    import loopax

    devices = jax.devices() if num_processes else jax.devices()[:1]
    trainer = loopax.Trainer(
        model_fn, loopax.losses.mean_squared_error, optax.sgd(0.1), devices=devices
    )
    loop = loopax.Loop(trainer)
    dataset = loopax.IterableDataset(lambda: local_share(num_processes, process_id), name="share")
    metrics = loop.run_epochs(dataset, 1)
    leaves = [np.asarray(jax.device_get(leaf)) for leaf in jax.tree.leaves(trainer.params)]
    np.savez(out_file, *leaves, loss=np.asarray(metrics["loss"]))
    print(f"process {process_id}: {trainer.num_devices} devices, step {trainer.global_step}")


if __name__ == "__main__":
    main()
