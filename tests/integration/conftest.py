"""Shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _fleet_logs_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """For tests on a ``fleet`` of real processes: where the logs are, and each process's last
    lines, printed in teardown (pytest shows it only for a failing test)."""
    yield
    if "fleet" in request.fixturenames:
        fleet = request.getfixturevalue("fleet")
        print(f"logs in {fleet.dir}\n{fleet.tails()}")
