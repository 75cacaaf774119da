"""These tests need four JAX devices: ``tests/tp/test_multidevice.py`` runs them in a child
process with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``; in the main run (one CPU
device) they are skipped, saying so."""

from __future__ import annotations

import jax
import pytest

DEVICES = 4


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if len(jax.devices()) >= DEVICES:
        return
    skip = pytest.mark.skip(reason=f"needs {DEVICES} JAX devices: run by tests/tp/"
                                   "test_multidevice.py with forced host devices")
    for item in items:
        if "tests/tp/multidevice" in str(item.fspath):
            item.add_marker(skip)
