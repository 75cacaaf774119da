"""Before joining a multi-process instance, a rank checks that gloo's collectives can reach the
other hosts: gloo binds the address the host name resolves to, and loopback reaches no one."""

from __future__ import annotations

import pytest

from pd_fsm.jax_engine.parallel.distributed import collectives_address_problem


@pytest.mark.parametrize(("coordinator", "resolved", "problem"), [
    ("10.0.0.1", "127.0.1.1", "resolves to 127.0.1.1, a loopback address"),
    ("10.0.0.1", None, "does not resolve"),
    ("127.0.0.1", "127.0.0.1", None),  # every rank on this host: loopback is right
    ("10.0.0.1", "10.0.0.2", None),
])
def test_a_host_name_gloo_cannot_use_is_refused_with_the_fix(
        coordinator: str, resolved: str | None, problem: str | None) -> None:
    found = collectives_address_problem(coordinator, "node7", resolved)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found and "'node7'" in found
