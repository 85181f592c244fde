"""The checkpoints' layout-independent fingerprints: the same number on every layout, on
the devices and on the host, and a different one when one float moves by one ulp."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from loopax.hooks._checkpointing._fingerprint import (
    combine,
    describe,
    device_checks,
    host_fingerprint,
    local_checks,
)

RNG = np.random.default_rng(0)
ARRAYS = [
    RNG.standard_normal((8, 64)).astype(np.float32),
    np.arange(12, dtype=np.int32).reshape(4, 3),
    RNG.standard_normal((16,)).astype(jnp.bfloat16),
    np.array([True, False, True, True]),
    np.float32(3.0),
]


def _mesh(shape):
    count = int(np.prod(shape))
    names = ("data", "model")[: len(shape)]
    return jax.make_mesh(
        shape,
        names,
        devices=jax.devices()[:count],
        axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
    )


def _on_devices(arrays, mesh, specs):
    sums, finite = combine(
        [
            local_checks(
                device_checks(
                    [
                        jax.device_put(a, NamedSharding(mesh, s))
                        for a, s in zip(arrays, specs, strict=True)
                    ]
                )
            )
        ]
    )
    return [describe(a.dtype, np.shape(a), v) for a, v in zip(arrays, sums, strict=True)], finite


LAYOUTS = {
    "1x1": ((1,), [P()] * 5),
    "4 replicated": ((4,), [P()] * 5),
    "4 sharded": ((4,), [P("data"), P("data"), P("data"), P("data"), P()]),
    "2x2": ((2, 2), [P("data", "model"), P("model"), P(("data", "model")), P("data"), P()]),
    "2x2 transposed": (
        (2, 2),
        [P("model", None), P(None, None), P("data"), P(("model", "data")), P()],
    ),
}


@pytest.mark.cpu_devices
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_fingerprint_is_the_same_on_every_layout_and_on_the_host(layout):
    shape, specs = LAYOUTS[layout]
    fingerprints, finite = _on_devices(ARRAYS, _mesh(shape), specs)
    assert fingerprints == [host_fingerprint(a) for a in ARRAYS]
    assert finite == [True] * len(ARRAYS)


@pytest.mark.cpu_devices
def test_one_ulp_changes_the_fingerprint_and_nan_is_seen():
    moved = ARRAYS[0].copy()
    moved[3, 5] = np.nextafter(moved[3, 5], np.float32(np.inf))
    broken = ARRAYS[0].copy()
    broken[0, 0] = np.nan
    assert host_fingerprint(moved) != host_fingerprint(ARRAYS[0])
    mesh = _mesh((2, 2))
    fingerprints, finite = _on_devices([moved, broken], mesh, [P("data", "model")] * 2)
    assert fingerprints[0] == host_fingerprint(moved) != host_fingerprint(ARRAYS[0])
    assert finite == [True, False]


def test_the_stored_form_names_dtype_and_shape():
    assert host_fingerprint(np.zeros((2, 3), np.float32)).startswith("float32[2,3]:")
    assert host_fingerprint(np.zeros((6,), np.float32)) != host_fingerprint(
        np.zeros((2, 3), np.float32)
    )
