"""The one place pd_fsm uses a private name of ``jax.experimental.transfer``.

``TransferConnection._poison_connection()`` is the only way to make the pulls still outstanding
on a connection fail at once instead of hanging (``jax_transfer``'s module docstring has the
measurement); the library offers no public equivalent. A private name can vanish in any JAX
release, so every use goes through this module, :data:`MISSING` says at import which names this
JAX lacks (logged, not raised: a colocated worker never poisons anything and must still start),
and ``tests/unit/test_jax_private_api.py`` fails naming the name and the JAX version.
"""

from __future__ import annotations

import logging

import jax
from jax.experimental import transfer

log = logging.getLogger(__name__)

_POISON = "_poison_connection"

# Each private name we call, on the class that must have it: what the check and the test read.
PRIVATE_NAMES: tuple[tuple[type, str], ...] = ((transfer.TransferConnection, _POISON),)


def missing_names() -> list[str]:
    """``Class.name`` for every private name this JAX does not have."""
    return [f"{cls.__name__}.{name}" for cls, name in PRIVATE_NAMES if not hasattr(cls, name)]


def describe_missing(names: list[str]) -> str:
    return (f"jax {jax.__version__} has no {', '.join(names)} (a private name of "
            f"jax.experimental.transfer that pd_fsm/jax_engine/transfer/jax_private.py uses)")


MISSING = missing_names()
if MISSING:
    log.error("%s: failed KV pulls will no longer fail their connection's other pulls at once",
              describe_missing(MISSING))


def poison(conn: transfer.TransferConnection) -> None:
    """Make every pull still outstanding on ``conn`` fail at once; later pulls on it fail too.
    An AttributeError naming the JAX version if this JAX lacks the private method."""
    try:
        method = getattr(conn, _POISON)
    except AttributeError:
        raise AttributeError(describe_missing([f"{type(conn).__name__}.{_POISON}"])) from None
    method()
