"""Host arrays onto the device as transfers, without compiling anything.

``jnp.asarray`` of a numpy array runs a small jitted program (``jit(stage)`` in JAX 0.10),
compiled once per shape and dtype: a step's packed inputs, a sampler's rows or a page table of a
size not seen before compiled on its first request, after the warm-up and outside its count
(~10-30 ms each on a CPU).
``jax.device_put`` is a plain transfer, with the same dtypes (64-bit host values canonicalized
to 32 bits)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np


def upload(host: jax.Array | np.ndarray | Sequence[int] | Sequence[float] | int) -> jax.Array:
    """``host`` on the default device (uncommitted, as ``jnp.asarray`` would place it); an array
    already on a device as it is."""
    if isinstance(host, jax.Array):
        return host
    out: jax.Array = jax.device_put(np.asarray(host))
    return out
