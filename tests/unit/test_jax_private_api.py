"""The private names of ``jax.experimental.transfer`` that pd_fsm calls (all through
``pd_fsm/jax_engine/transfer/jax_private.py``) still exist in the installed JAX, on the classes
the transfer engine really gets, and still do what the engine relies on. A JAX upgrade that
drops one fails here, by name and version, instead of as an AttributeError in a worker's first
failed pull."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import pytest
from jax.experimental import transfer

import pd_fsm
from pd_fsm.jax_engine.transfer import jax_private

SHIM = Path(jax_private.__file__)


def _version() -> str:
    return f"jax {jax.__version__}, jaxlib {jaxlib.__version__}"


def test_this_jax_has_every_private_name_we_call() -> None:
    missing = jax_private.missing_names()
    assert not missing, (
        f"{_version()} no longer has {', '.join(missing)}, which "
        f"pd_fsm/jax_engine/transfer/jax_private.py calls: find its replacement in this JAX "
        f"(or pin JAX) before upgrading"
    )
    assert jax_private.MISSING == []  # the import-time check agrees


def test_the_check_reads_the_class_of_our_connections() -> None:
    """``JaxTransferKVEngine`` gets its connections from ``TransferServer.connect``: those are
    instances of the class the check reads, and poisoning one fails its outstanding pull at once
    (a pull of a uuid never registered would otherwise wait forever)."""
    device = jax.local_devices()[0]
    server = transfer.start_transfer_server(device.client, "127.0.0.1:0", ["127.0.0.1:0"])
    conn = server.connect(server.address())
    checked = {cls for cls, _ in jax_private.PRIVATE_NAMES}
    assert isinstance(conn, tuple(checked)), (
        f"{_version()}: TransferServer.connect returns {type(conn)!r}, not one of the classes "
        f"jax_private checks ({checked})"
    )
    spec = jax.ShapeDtypeStruct((4,), jnp.uint32,
                                sharding=jax.sharding.SingleDeviceSharding(device))
    (pending,) = conn.pull(2**40 + 17, [spec])
    jax_private.poison(conn)
    deadline = time.monotonic() + 10
    while not pending.is_ready() and time.monotonic() < deadline:
        time.sleep(0.01)
    # The poisoned connection fails the pull with the injected failure, or (seen once in a
    # full-suite run: JAX's two sides race) with the socket the poison closed.
    with pytest.raises(Exception, match=r"InjectFailure|Connection closed"):
        jax.block_until_ready(pending)


def _private_transfer_names() -> set[str]:
    classes = (transfer.TransferConnection, transfer.TransferServer)
    return {n for cls in classes for n in dir(cls) if n.startswith("_") and not n.startswith("__")}


def test_no_module_but_the_shim_names_a_private_transfer_name() -> None:
    """Every use of a private name of ``jax.experimental.transfer`` goes through the shim: as an
    attribute (``conn._poison_connection()``) or a string (``getattr``) anywhere else, it would
    escape the check above."""
    private = _private_transfer_names()
    assert "_poison_connection" in private
    found = []
    for path in sorted(Path(pd_fsm.__file__).parent.rglob("*.py")):
        if path == SHIM:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in private:
                found.append(f"{path}:{node.lineno} .{node.attr}")
            elif isinstance(node, ast.Constant) and node.value in private:
                found.append(f"{path}:{node.lineno} {node.value!r}")
    assert not found, f"private jax.experimental.transfer names outside {SHIM.name}: {found}"
