"""Shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="package", autouse=True)
def _compilation_cache() -> Iterator[None]:
    """The schedulers these tests build in this process load their executables from the
    compilation cache, as the `pd-fsm serve` workers they start do (same directory; writes are
    atomic): without it this process compiled every shape afresh on each run (SmolLM2's most
    of all). Off again after this package: in a run of the whole suite in one process, the
    other directories run as `make test`'s first phase runs them, without it."""
    from pd_fsm.jax_engine.compilation import cache
    from pd_fsm.jax_engine.compilation.executables import EXECUTABLES

    cache.enable(cache.default_dir())
    yield
    EXECUTABLES.use_store(None)


@pytest.fixture(autouse=True)
def _fleet_logs_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """For tests on a ``fleet`` of real processes: where the logs are, and each process's last
    lines, printed in teardown (pytest shows it only for a failing test)."""
    yield
    if "fleet" in request.fixturenames:
        fleet = request.getfixturevalue("fleet")
        print(f"logs in {fleet.dir}\n{fleet.tails()}")
