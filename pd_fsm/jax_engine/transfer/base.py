"""The transfer backend's interface (RFC-2 §5.1: the KVManager / KVSender / KVReceiver concepts).

* KVManager  -> :class:`KVTransferEngine`: one per process; owns the transfer server, the
  connections to peers and the table of registrations.
* KVSender   -> the sender half of the engine, used per room on P:
  :meth:`~KVTransferEngine.register` the packed KV under a uuid,
  :meth:`~KVTransferEngine.release` it when the core says so (``ReleaseKV``: DONE, abort, or the
  core's kv_hold_lease running out). The engine also has a lease and a reaper of its own
  (:meth:`~KVTransferEngine.extend_lease`, ``reap_expired``) for embedders without the core;
  pd_fsm's schedulers turn the reaper off (``reaper_interval_s=None``) so that exactly one owner,
  the core's table, decides when a registration goes.
* KVReceiver -> the receiver half, used per room on D through
  :class:`pd_fsm.jax_engine.transfer.pull_executor.PullExecutor`:
  :meth:`~KVTransferEngine.start_pull` returns a :class:`PendingPull` whose
  :meth:`~PendingPull.wait` is bounded by a deadline.

Nothing here knows about rooms' protocol states; the scheduler maps outcomes to core events.
"""

from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

import attrs
import jax

UUID_LIMIT = 1 << 64  # jax.experimental.transfer keys registrations by uint64


def new_uuid() -> int:
    """A random registration id (63 bits, so it also fits signed 64-bit fields on the wire)."""
    return secrets.randbits(63)


class PullError(RuntimeError):
    """A pull failed (peer error, connection closed, shape mismatch reported by the library)."""


class PullTimeout(PullError):
    """A pull was not complete by its deadline."""


@attrs.frozen
class ReleaseResult:
    """What :meth:`KVTransferEngine.release` did. ``verified`` means the engine proved the uuid's
    entry is gone from the transfer server, not merely that it dropped its own references."""

    uuid: int
    released: bool
    verified: bool
    reason: str
    nbytes: int
    seconds: float


class PendingPull(ABC):
    """A pull in flight: ``arrays`` become valid once :meth:`wait` returns."""

    peer: str
    uuid: int
    arrays: list[jax.Array]

    @abstractmethod
    def wait(self) -> None:
        """Block until every array is ready, or raise :class:`PullError` / :class:`PullTimeout`.
        Returns or raises by the pull's deadline (plus a poll interval), never later."""


class KVTransferEngine(ABC):
    """One per process: serves this process's registrations and pulls from peers."""

    @property
    @abstractmethod
    def address(self) -> str:
        """What a peer passes to :meth:`start_pull` to reach this process."""

    # sender side (P) ----------------------------------------------------------------------------

    @abstractmethod
    def register(self, uuid: int, arrays: Sequence[jax.Array], lease_s: float) -> None:
        """Offer ``arrays`` for one pull under ``uuid``, held for ``lease_s`` seconds at most."""

    @abstractmethod
    def extend_lease(self, uuid: int, lease_s: float) -> bool:
        """Lease becomes ``max(old, now + lease_s)``; False if ``uuid`` is not registered."""

    @abstractmethod
    def release(self, uuid: int, reason: str) -> ReleaseResult:
        """Drop the registration and verify it is gone from the transfer server. Idempotent."""

    @abstractmethod
    def reap_expired(self) -> list[ReleaseResult]:
        """Release every registration whose lease has expired."""

    @abstractmethod
    def registrations(self) -> Mapping[int, int]:
        """uuid -> bytes of every registration currently held."""

    # receiver side (D) --------------------------------------------------------------------------

    @abstractmethod
    def start_pull(
        self, peer: str, uuid: int, specs: Sequence[jax.ShapeDtypeStruct], deadline_s: float
    ) -> PendingPull:
        """Start pulling ``uuid`` from ``peer``; the result is bounded by ``deadline_s`` seconds."""

    @abstractmethod
    def drop_connection(self, peer: str, reason: str) -> None:
        """Forget the cached connection to ``peer``: the next pull connects afresh."""

    @abstractmethod
    def close(self) -> None:
        """Release every registration and connection; stop background work."""
