"""Metrics under a real `jax.shard_map` over 4 simulated CPU devices.

The device count must be set before jax initializes its backend, so the check runs in a
fresh subprocess.
"""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import functools
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from loopax import metrics
    from loopax.testing import count_compilations

    assert jax.device_count() == 4, jax.devices()
    mesh = jax.make_mesh((4,), ("batch",))
    rng = np.random.default_rng(0)
    checks = [
        (metrics.SparseCategoricalAccuracy(),
         lambda: ([rng.integers(0, 3, 8).astype(np.int32), rng.uniform(size=8) < 0.7],
                  [rng.normal(size=(8, 3)).astype(np.float32)])),
        (metrics.MovingAverageBinaryLogitsAccuracy(new_example_weight=0.3),
         lambda: ([rng.integers(0, 2, 8).astype(np.float32),
                   rng.uniform(size=8).astype(np.float32)],
                  [rng.normal(size=8).astype(np.float32)])),
        (metrics.Mean("mse", lambda y, p: jnp.mean((y[0] - p[0]) ** 2)),
         lambda: ([rng.normal(size=8).astype(np.float32)],
                  [rng.normal(size=8).astype(np.float32)])),
    ]
    for metric, make_batch in checks:
        def device_partial(labels, predictions):
            # As the trainer does: gather every device's partial, then fold with merge.
            gathered = jax.tree.map(lambda x: jax.lax.all_gather(x, "batch"),
                                    metric.update(labels, predictions))
            parts = [jax.tree.map(lambda x: x[i], gathered) for i in range(4)]
            return functools.reduce(metric.merge, parts)

        @jax.jit
        def step(state, labels, predictions):
            partial = jax.shard_map(device_partial, mesh=mesh, in_specs=P("batch"),
                                    out_specs=P(), check_vma=False)(labels, predictions)
            state = metric.accumulate(state, partial)
            return state, metric.compute(state)

        # Replicated from the start, as step returns it: no recompilation on step 2.
        state = jax.device_put(metric.init(), NamedSharding(mesh, P()))
        single = metric.init()
        compiled_per_step = []
        for _ in range(3):
            labels, predictions = make_batch()
            sharded = jax.device_put((labels, predictions), NamedSharding(mesh, P("batch")))
            with count_compilations() as compiled:
                state, value = step(state, *sharded)
            compiled_per_step.append(compiled.count)

            single = metric.accumulate(single, metric.update(labels, predictions))
            np.testing.assert_allclose(value, metric.compute(single), rtol=1e-5)
        assert compiled_per_step == [1, 0, 0], compiled_per_step
    print("ok")
""")


def test_shard_map_on_four_devices_equals_one_device():
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().endswith("ok")
