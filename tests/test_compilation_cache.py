"""The persistent compilation cache is on by default, can move or be turned off, and a
second process loads its programs instead of compiling them again."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, sys
    import flax.linen as nn
    import jax
    import numpy as np
    import optax
    import loopax
    from loopax.testing import count_compilations

    if len(sys.argv) > 1:
        loopax.set_compilation_cache(None if sys.argv[1] == "none" else sys.argv[1])
    trainer = loopax.Trainer(lambda ctx, spec, inputs: nn.Dense(1)(nn.Dense(64)(inputs[0])),
                             loopax.losses.mean_squared_error, optax.adam(1e-3),
                             devices=jax.devices()[:1])
    x = np.ones((8, 32), np.float32)
    trainer.train_step(None, [x], [x[:, :1]])
    print(json.dumps({"dir": jax.config.jax_compilation_cache_dir}))
""")


def run(tmp_path, *args, **env):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "LOOPAX_"))}
    clean.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), **env)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, *args],
        env=clean,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])["dir"]


def entries(directory):
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def test_on_by_default_in_the_user_cache_directory_and_reused(tmp_path):
    default = str(tmp_path / "xdg" / "loopax" / "jax")
    assert run(tmp_path) == default
    written = entries(default)
    assert any("train" in name for name in written), written  # the train step's program
    assert run(tmp_path) == default
    assert entries(default) == written  # the second process compiled nothing new


@pytest.mark.parametrize("how", ["environment", "function"])
def test_it_moves_or_turns_off(tmp_path, how):
    moved = str(tmp_path / "moved")
    if how == "environment":
        assert run(tmp_path, LOOPAX_COMPILATION_CACHE=moved) == moved
        assert run(tmp_path / "off", LOOPAX_COMPILATION_CACHE="off") is None
    else:
        assert run(tmp_path, moved) == moved
        assert run(tmp_path / "off", "none") is None
    assert entries(moved)
    assert not (tmp_path / "off" / "xdg").exists()


def test_a_cache_the_user_configured_is_left_alone(tmp_path):
    own = str(tmp_path / "own")
    assert run(tmp_path, JAX_COMPILATION_CACHE_DIR=own) == own
    assert not (tmp_path / "xdg").exists()
