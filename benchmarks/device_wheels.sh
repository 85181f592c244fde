#!/usr/bin/env bash
# Downloads into .whl/ the wheels `benchmarks/device_run.sh` installs on a GPU machine of the
# device tool, which has no package registry: what the project's tests use and that machine's
# image lacks (docs/benchmarks.md, "On a GPU"). Run here, in the repository's root, once:
#
#   bash benchmarks/device_wheels.sh
#
# Python 3.12, manylinux x86-64 (that machine's interpreter). loopax's own dependencies (jax,
# flax, optax, orbax-checkpoint, tensorboard, numpy, tqdm) are in its image already. The
# mlflow tests' packages (mlflow-skinny and its ~20 dependencies, sqlalchemy, alembic) and
# Keras (benchmarks/requirements.txt) are left out: those tests skip, and the device
# benchmark needs no Keras.
set -eu
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl \
    "grain==0.2.18" "array-record==0.8.6" "portpicker==1.6.0"
ls -l .whl
