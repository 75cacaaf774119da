"""KV transfer backends: the interface (:mod:`.base`) and the ``jax.experimental.transfer`` one."""

from pd_fsm.jax_engine.transfer.base import (
    KVTransferEngine,
    PendingPull,
    PullError,
    PullTimeout,
    ReleaseResult,
    new_uuid,
)
from pd_fsm.jax_engine.transfer.jax_transfer import DEFAULT_TRANSFER_SIZE, JaxTransferKVEngine

__all__ = [
    "DEFAULT_TRANSFER_SIZE",
    "JaxTransferKVEngine",
    "KVTransferEngine",
    "PendingPull",
    "PullError",
    "PullTimeout",
    "ReleaseResult",
    "new_uuid",
]
