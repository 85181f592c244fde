"""`loopax.testing.count_compilations`: counts real XLA compilations, not cache hits."""

import functools

import jax
import jax.numpy as jnp
import pytest

from loopax.testing import count_compilations


def _fresh_jit():
    # A new function object per test, so no test sees another's cached executables.
    @jax.jit
    def scale(x):
        return 3 * x + 1

    return scale


def test_new_shape_compiles_once_and_cache_hit_compiles_nothing():
    scale = _fresh_jit()
    three, other_three, five = jnp.ones(3), jnp.zeros(3), jnp.ones(5)
    with count_compilations() as first:
        scale(three).block_until_ready()
    with count_compilations() as same_shape:
        scale(other_three).block_until_ready()
        scale(three).block_until_ready()
    with count_compilations() as new_shape:
        scale(five).block_until_ready()
    assert (first.count, same_shape.count, new_shape.count) == (1, 0, 1)
    assert first.names == ["jit(scale)"]
    assert int(new_shape) == 1


def test_new_dtype_and_static_argument_compile():
    @functools.partial(jax.jit, static_argnums=1)
    def power(x, exponent):
        return x**exponent

    x32, x16 = jnp.ones(4, jnp.float32), jnp.ones(4, jnp.float16)
    power(x32, 2).block_until_ready()
    with count_compilations() as compiled:
        power(x32, 2).block_until_ready()  # cached
        power(x16, 2).block_until_ready()  # new dtype
        power(x32, 3).block_until_ready()  # new static argument
    assert compiled.names == ["jit(power)", "jit(power)"]


def test_eager_operation_on_a_new_shape_counts():
    with count_compilations() as compiled:
        jnp.arange(7, dtype=jnp.float32).sum().block_until_ready()
    assert compiled.count >= 1


def test_nested_blocks_each_count_their_own():
    scale = _fresh_jit()
    two, six = jnp.ones(2), jnp.ones(6)
    with count_compilations() as outer:
        scale(two).block_until_ready()
        with count_compilations() as inner:
            scale(six).block_until_ready()
        assert (outer.count, inner.count) == (2, 1)
    assert (outer.count, inner.count) == (2, 1)


def test_counting_stops_when_the_block_exits_even_on_error():
    scale = _fresh_jit()
    eight, nine = jnp.ones(8), jnp.ones(9)
    with pytest.raises(ZeroDivisionError), count_compilations() as compiled:
        scale(eight).block_until_ready()
        _ = 1 / 0
    scale(nine).block_until_ready()  # after the block: not counted
    assert compiled.count == 1
