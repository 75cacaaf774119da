"""Padding sizes so that jitted functions compile a bounded number of times."""

from __future__ import annotations


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = max(n, minimum, 1)
    return 1 << (n - 1).bit_length()
