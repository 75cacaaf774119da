"""Runs ``tests/tp/multidevice`` in a child process with four forced host devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=4``): JAX fixes its device count when its
backend starts, and this test process has started it with one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pd_fsm.io_trio.worker.config import force_host_devices
from tests.tp.multidevice.conftest import DEVICES

pytestmark = pytest.mark.slow


def test_multidevice_suite() -> None:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    force_host_devices(env, DEVICES)
    here = Path(__file__).parent
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
         str(here / "multidevice")],
        env=env, cwd=here.parent.parent, capture_output=True, text=True, timeout=600,
    )
    report = run.stdout[-6000:] + run.stderr[-3000:]
    assert run.returncode == 0, report
    # Every test ran: none skipped for want of devices.
    assert " passed" in run.stdout and "skipped" not in run.stdout, report
