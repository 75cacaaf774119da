"""The KV checksum (``pd_fsm.jax_engine.kv.checksum``): its definition computed by hand, the host
and the on-device ways agree on every dtype and size, and the corruptions it exists for change
it."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_fsm.jax_engine.kv.checksum import ROW_WORDS, host_checksum, kv_checksum


def _by_hand(buffer: np.ndarray) -> int:
    """The definition, in plain Python integers."""
    raw = buffer.tobytes() + b"\0" * (-buffer.nbytes % 4)
    words = [int.from_bytes(raw[i : i + 4], "little") for i in range(0, len(raw), 4)]
    rows = [sum(words[r : r + ROW_WORDS]) for r in range(0, len(words), ROW_WORDS)]
    return sum((2 * r + 1) * s for r, s in enumerate(rows)) % (1 << 32)


@pytest.mark.parametrize(("shape", "dtype"), [
    ((3, 5, 7), np.float32),
    ((2, ROW_WORDS + 1), np.float32),  # a short last row
    ((4, ROW_WORDS), np.uint16),  # bf16 KV as the pool keeps it
    ((5, 3), ml_dtypes.bfloat16),
    ((2, 3, 4, 5), np.float16),
    ((7,), np.uint8),  # not a whole number of words: the last one zero-padded
    ((1,), np.float32),
])
def test_host_and_device_agree_with_the_definition(shape: tuple[int, ...], dtype: type) -> None:
    rng = np.random.default_rng(sum(shape))
    host = rng.integers(0, 256, size=(int(np.prod(shape)) * np.dtype(dtype).itemsize,),
                        dtype=np.uint8).view(dtype).reshape(shape)
    array = jnp.asarray(host)
    assert host_checksum(host) == _by_hand(host)
    # What the device holds: a TPU canonicalises some float16 bit patterns on the way in.
    want = _by_hand(np.ascontiguousarray(array))
    assert kv_checksum(array, on_device=False) == want
    assert kv_checksum(array, on_device=True) == want


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 4 * 3 * ROW_WORDS - 1), st.integers(0, 7))
def test_any_flipped_bit_changes_it(byte: int, bit: int) -> None:
    host = np.random.default_rng(1).standard_normal((3, ROW_WORDS)).astype(np.float32)
    flipped = host.copy()
    flipped.reshape(-1).view(np.uint8)[byte] ^= 1 << bit
    assert host_checksum(flipped) != host_checksum(host)


def test_rows_that_land_at_each_others_place_change_it() -> None:
    """A 64 KiB chunk swapped with another (a transfer writing chunks at the wrong offsets): a
    plain sum of the words would not see it."""
    host = np.random.default_rng(2).standard_normal((4, ROW_WORDS)).astype(np.float32)
    swapped = host[[0, 2, 1, 3]]
    assert swapped.view(np.uint32).sum(dtype=np.uint32) == host.view(np.uint32).sum(
        dtype=np.uint32)
    assert host_checksum(swapped) != host_checksum(host)
