"""bf16 KV kept as its bits (``kv.pool.KVPoolConfig.storage_dtype``): ``kv_encode`` rounds to
nearest even as the f32 -> bf16 cast is defined (ml_dtypes'; JAX's own on a CPU), bit for bit, and
``kv_decode`` gives back that bf16 value. A TPU's own cast flushes subnormals to zero; the
encoding keeps them (seen on a TPU v5e, where the two differ on those alone)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pd_fsm.jax_engine.kv.pool import KVPoolConfig
from pd_fsm.jax_engine.model.forward import kv_decode, kv_encode


def test_encode_rounds_as_the_cast_and_decode_is_exact() -> None:
    rng = np.random.default_rng(3)
    x = np.concatenate([
        rng.standard_normal(10_000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 10_000),
        np.array([0.0, -0.0, 1.0, -1.0, 3.0e38, -3.0e38, 1e-40, 1.00390625, 1.01171875],
                 np.float32),  # ties to even both ways, a subnormal, near the top
    ])
    bits = kv_encode(jnp.asarray(x), jnp.dtype(jnp.uint16))
    assert bits.dtype == jnp.uint16
    defined = x.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(bits), defined.view(np.uint16))
    if jax.default_backend() == "cpu":
        cast = jax.lax.bitcast_convert_type(jnp.asarray(x).astype(jnp.bfloat16), jnp.uint16)
        np.testing.assert_array_equal(np.asarray(bits), np.asarray(cast))
    np.testing.assert_array_equal(np.asarray(kv_decode(bits)), defined.astype(np.float32))


def test_f32_pools_are_plain_casts() -> None:
    x = jnp.asarray([1.5, -2.25], jnp.float32)
    assert kv_encode(x, jnp.dtype(jnp.float32)).dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(kv_decode(x)), np.asarray(x))
    assert KVPoolConfig(1, 2, 4, 1, 8, "bfloat16").storage_dtype == "uint16"
    assert KVPoolConfig(1, 2, 4, 1, 8).storage_dtype == "float32"
