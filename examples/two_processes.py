"""Train the digits MLP on 2 processes (2 CPU devices each) joined by `jax.distributed`.

    python examples/two_processes.py                  # starts both processes on this machine
    python examples/two_processes.py --dir runs/two   # again with the same --dir: it resumes

With no `--process-id` the script is a launcher: it picks a free port on 127.0.0.1 and starts
itself twice, as processes 0 and 1, each with 2 simulated CPU devices and gloo collectives,
and waits for both. Each process then runs the same training code as one process would:

- `jax.distributed.initialize(...)` joins the processes; `jax.devices()` are then all 4
  devices, and the Trainer splits every global batch over them.
- Every process reads its own share of the data (here every other example) with the same
  shuffling seed: a process's batches are its share of the global batch.
- `hooks.checkpoint` writes one checkpoint from all processes into one directory (on a
  cluster: a directory every process sees, e.g. a shared file system or a bucket).
- Evaluation shares may be uneven (here 180 and 180 test examples, but any split works): the
  processes agree on each batch's size and the results are those of the whole test split.
- Ctrl-C, or a SIGTERM to either process (a preemption notice), stops both after the same
  step; the checkpoint hook saves it, and a rerun resumes from it.
- A process that dies (SIGKILL, a lost host) ends the other within about 12 s: it prints
  one line, `loopax: lost process 1 of 2 (no heartbeat for 10.0 s); the last checkpoint
  every process committed is step 400 (...), where a rerun resumes; ...`, and exits with
  `loopax.LOST_PROCESS_EXIT` (75, EX_TEMPFAIL), as does this launcher; run it again with the
  same `--dir` and it resumes from that step. The bound is `LOOPAX_LOST_PROCESS_TIMEOUT`
  (seconds of silence, default 10), and JAX's own: a dead coordinator (process 0) is seen
  at once, and `jax.distributed.initialize(..., heartbeat_timeout_seconds=100)` (its
  default) declares a silent process dead; loopax ends those the same way.

On a cluster, run the same script once per host with `--cluster` (and nothing else): there
`jax.distributed.initialize()` with no arguments finds the coordinator, the process count and
this process's index itself on SLURM (`srun python examples/two_processes.py --cluster`),
Kubernetes (a JobSet / indexed Job) and Cloud TPU pods, and each process uses its host's
accelerators. Nothing else in the script changes.

The last line each process prints is `process N: test accuracy 0.9xx` (the same on both).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

PROCESSES = 2
DEVICES_PER_PROCESS = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="global step to train to")
    parser.add_argument("--batch-size", type=int, default=64, help="the global batch")
    parser.add_argument("--dir", default="runs/two_processes", help="checkpoints")
    parser.add_argument("--cluster", action="store_true", help="initialize from the cluster")
    parser.add_argument("--process-id", type=int, help="(set by the launcher)")
    parser.add_argument("--coordinator", help="(set by the launcher) host:port of process 0")
    return parser.parse_args(argv)


def launch(argv: list[str]) -> int:
    """Starts this script as processes 0 and 1 on this machine; their worst exit status."""
    from loopax import LOST_PROCESS_EXIT  # noqa: PLC0415 - jax loads in the workers only
    from loopax.testing import free_port  # noqa: PLC0415

    coordinator = f"127.0.0.1:{free_port()}"
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}"
    env["JAX_PLATFORMS"] = "cpu"
    processes = [
        subprocess.Popen(
            [sys.executable, __file__, *argv, "--process-id", str(process_id)]
            + ["--coordinator", coordinator],
            env=env,
        )
        for process_id in range(PROCESSES)
    ]
    statuses = []
    for process in processes:
        while True:
            try:
                statuses.append(process.wait())
                break
            except KeyboardInterrupt:  # Ctrl-C reached the processes too: wait for their save
                continue
    if LOST_PROCESS_EXIT in statuses:  # a process was lost: the job can be run again
        return LOST_PROCESS_EXIT
    status = next((status for status in statuses if status), 0)
    return 128 - status if status < 0 else status  # killed by a signal: as a shell says it


def say(line: str) -> None:
    """Prints `line` in one write, so that the processes' lines do not interleave."""
    os.write(sys.stdout.fileno(), f"{line}\n".encode())


def train(args: argparse.Namespace) -> float:
    import jax

    if args.cluster:
        jax.distributed.initialize()  # SLURM, Kubernetes, TPU pods: found from the environment
    else:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives
        jax.distributed.initialize(args.coordinator, PROCESSES, args.process_id)

    import loopax
    from loopax import hooks, losses, metrics, optimizers

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from digits import load_digits, model_fn

    process, count = jax.process_index(), jax.process_count()
    (train_x, train_y), (test_x, test_y) = load_digits(seed=0)
    usable = len(train_y) // count * count  # equal train shares: every step is one per process
    train_x, train_y = train_x[:usable], train_y[:usable]
    # This process's share: every count-th example. The same seed on every process, so
    # that each shuffles its share alike and the checkpointed position fits all.
    train = loopax.ArrayDataset(
        train_x[process::count],
        train_y[process::count],
        args.batch_size // count,
        name="train",
        seed=0,
        loop_forever=True,
    )
    test = loopax.ArrayDataset(
        test_x[process::count],
        test_y[process::count],
        args.batch_size // count,
        name="test",
        shuffle=False,
        drop_remainder=False,
    )
    trainer = loopax.Trainer(
        model_fn,
        losses.sparse_categorical_crossentropy_logits,
        optimizers.from_name("adam", learning_rate=1e-3),
        eval_metrics=[metrics.SparseCategoricalAccuracy()],
        devices=jax.devices(),  # every process's devices
    )
    loop = loopax.Loop(trainer)
    # Every process saves its own part in the background; they agree through JAX's
    # coordination service, never through a device collective beside the steps.
    hooks.checkpoint(loop, os.path.join(args.dir, "checkpoints"), every_n_steps=200)
    if trainer.global_step > 0:
        say(f"process {process}: resumed from step {trainer.global_step}")
    hooks.evaluate(loop, [test], every_n_steps=200)
    loop.run_to_step(train, args.steps)
    accuracy = trainer.evaluate(test)["Accuracy"]
    say(f"process {process}: test accuracy {accuracy:.3f}")
    return accuracy


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.process_id is None and not args.cluster:
        sys.exit(launch(argv))
    train(args)


if __name__ == "__main__":
    main()
