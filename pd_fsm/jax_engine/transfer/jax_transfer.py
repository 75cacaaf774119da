"""``JaxTransferKVEngine``: the KV transfer backend on ``jax.experimental.transfer``.

One transfer server per process, started with explicit transport addresses (``host:0``): with an
empty list the serving process aborted on a cross-process pull (shared/JAX_TRANSFER.md).

Settings, each chosen by measurement against the library's defaults (two processes on 127.0.0.1,
2-vCPU machine; bench/RESULTS_transfer.md has this code's own figures):

* ``transfer_size`` 512 KiB instead of 256 MiB: the chunks pipeline through the sender's and the
  receiver's staging buffers (8 x 512 KiB stay in cache) instead of one chunk covering the whole
  array. 256 MiB, one process pair (with page faults on D taken out of the picture by keeping
  freed memory, see :mod:`pd_fsm.jax_engine.kv.host_memory`): 512 KiB 3.0 GB/s, 1 MiB 2.5-2.7,
  4 MiB 2.3-2.5, 256 KiB 2.2, the library default 1.4; 512 KiB was also ahead or level at 1, 16
  and 64 MiB.
* ``use_raw_buffers=True``: the sender reads the registered buffers through raw aliases instead of
  the PjRt buffer copy path (256 MiB, 4 MiB chunks: 1.19-1.55 GB/s against 0.94-1.31; also
  ahead at 1-64 MiB). Measured safe: the alias keeps the memory alive after every Python
  reference is dropped and after an explicit ``delete()`` (bit-exact pull after churning the
  allocator), and re-registering the uuid still frees it (the release below).
* ``transport_streams`` 2: two bulk-transport sockets per connection. Ahead at 16-64 MiB and with
  D's page faults taken out, within noise otherwise.

Connections are cached per peer. A connection on which a pull failed stays poisoned (later pulls on
it fail at once, even to a new server on the same port), so after any failure or timeout it is
*retired*: removed from the cache so the next pull connects afresh, and, once no other pull of ours
is still using it, poisoned with ``_poison_connection()`` (private to the library: called through
:mod:`~pd_fsm.jax_engine.transfer.jax_private` only). Measured: poisoning makes every pull still
outstanding on that connection fail at once ("RECOVERABLE InjectFailure") instead of hanging
— a pull to a dead port, or for a uuid never registered, otherwise waits forever, even with the
library's timeout, which the serving side only checks when its table is touched.

A peer that dies (bench/RESULTS_dead_peer.md, jax 0.10.2, CPU, P SIGKILLed): a pull on a
connection that was open when P died fails at once ("Connection closed", within ~30 ms of the
kill, mid-transfer or waiting for a registration), but a pull on a *fresh* connection to the dead
port waits until its deadline: the library's connect does not report the refusal. Hence two
things here. A new connection is first probed with a plain TCP connect to the peer's address
(~0.05 ms when P listens): a refusal (nothing listens: P's process is gone) fails the pull at once
instead of the deadline; a probe without an answer in ``_PROBE_S`` leaves it to the library. And
:meth:`JaxTransferKVEngine.drop_connection` (the core's ForgetTransfer: P lost or restarted)
poisons every connection to the peer at once, those with pulls in flight too: a pull blocked on a
dead or hung P then returns within a few ms instead of at its deadline, and frees its pull thread.

Deadlines. ``pull()`` returns at once and errors surface at ``is_ready()`` /
``block_until_ready()``; ``block_until_ready`` can hang (for a uuid never registered, or a dead
port). So :meth:`_JaxPendingPull.wait` polls ``is_ready()`` against our own monotonic deadline,
pausing 1/20 of the time waited so far between polls. Measured alternatives at 1 MiB (~0.7 ms
transfers): a doubling 0.2-2 ms backoff woke up to 2x late; ``block_until_ready`` on a waiter
thread plus an ``Event.wait(deadline)`` added ~1 ms of thread hand-off on this 2-core machine.

Releasing one registration (the library has no API for it; ``_reset_rendevous_table()`` drops
*every* registration). A registration never pulled keeps its buffers alive in the C++ table after
every Python reference is gone. Mechanism found by experiment (jax/jaxlib 0.10.2, CPU):

1. Re-register the uuid with a tiny placeholder: re-registering *replaces* the entry, and the old
   buffers are freed right away. Measured: 256 MiB registered, Python reference dropped, RSS
   454 MiB; after the re-register 198 MiB, 15 ms later (test_transfer_lease measures it again).
2. Pull the placeholder back over a connection from this server to itself. Registrations are
   one-shot, so the pull erases the entry; and getting back the placeholder's unique marker proves
   the table held our placeholder, i.e. the original buffers were replaced. That is the
   verification (``ReleaseResult.verified``). If the marker does not come back within
   ``release_verify_s`` (a peer's racing pull took the placeholder; it then fails on size), the
   self-connection is poisoned and replaced and the result says ``verified=False``; the
   placeholder was registered with a library timeout as well, so it expires at the next table
   activity in any case.

The same release runs for DONE (the entry was usually already erased by D's pull; step 1 then just
adds a placeholder that step 2 consumes), abort and lease expiry. A reaper thread releases expired
leases every ``reaper_interval_s``.
"""

from __future__ import annotations

import datetime
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import transfer

from pd_fsm.jax_engine.transfer import jax_private
from pd_fsm.jax_engine.transfer.base import (
    UUID_LIMIT,
    KVTransferEngine,
    PendingPull,
    PullError,
    PullTimeout,
    ReleaseResult,
    new_uuid,
)

log = logging.getLogger(__name__)

DEFAULT_TRANSFER_SIZE = 512 << 10
DEFAULT_TRANSPORT_STREAMS = 2
_POLL_MIN_S = 50e-6
_SPIN_S = 2e-3  # poll without sleeping for the first 2 ms of a wait
_POLL_MAX_S = 2e-3
_PROBE_S = 0.5  # the longest a new connection's probe waits for the peer to answer


def _library_timeout(seconds: float) -> datetime.datetime:
    # Absolute, truncated to whole seconds by the library: round up and add one so that the
    # library never gives up before our own deadline does.
    return datetime.datetime.now() + datetime.timedelta(seconds=math.ceil(seconds) + 1)


@attrs.define
class _Conn:
    peer: str
    conn: Any  # jax.experimental.transfer.TransferConnection
    inflight: int = 0
    retired: bool = False
    poisoned: bool = False


@attrs.define
class _Registration:
    uuid: int
    nbytes: int
    expires_at: float


def refused(peer: str, timeout: float) -> str:
    """Why nothing can be listening at ``peer`` ("host:port"): its refusal of a TCP connection;
    "" when something answered, nothing answered within ``timeout``, or the address does not
    parse (the library's connect decides those)."""
    host, _, port = peer.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return ""
    except ConnectionRefusedError as exc:
        return str(exc)
    except (OSError, ValueError):
        return ""


def _wait_ready(
    arrays: Sequence[jax.Array], deadline: float, clock: Callable[[], float]
) -> str | None:
    """None once every array is ready and error-free; an error text; or 'timeout'.

    Polls ``is_ready()`` (cheap) and never calls ``block_until_ready`` on an array that is not
    ready, since that can hang. The pause between polls is 1/20 of the time waited so far
    (50 us .. 2 ms): the wake-up delay stays within ~5% of the transfer time plus ~50 us, with a
    few hundred wake-ups at most for a long transfer.
    """
    start = clock()
    while True:
        try:
            # is_ready() comes from jaxlib's C++ ArrayImpl (a concrete jax.Array); no stub has it.
            if all(a.is_ready() for a in arrays):  # type: ignore[attr-defined]
                jax.block_until_ready(list(arrays))  # ready: returns at once, raises on error
                return None
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        now = clock()
        if now >= deadline:
            return "timeout"
        if now - start < _SPIN_S:
            time.sleep(0)  # a small pull is done within a millisecond: yield, do not nap
            continue
        time.sleep(min(max((now - start) / 20, _POLL_MIN_S), _POLL_MAX_S, deadline - now))


def _poison(c: _Conn) -> None:
    """Poison ``c`` (its pulls fail at once). Without the private name (a JAX that dropped it:
    jax_private.MISSING, logged at import) pulls on it end by their own deadlines instead."""
    try:
        jax_private.poison(c.conn)
    except AttributeError as exc:
        log.warning("connection to %s not poisoned: %s", c.peer, exc)


class _JaxPendingPull(PendingPull):
    def __init__(
        self,
        engine: JaxTransferKVEngine,
        conn: _Conn,
        uuid: int,
        arrays: list[jax.Array],
        deadline: float,
    ) -> None:
        self.peer = conn.peer
        self.uuid = uuid
        self.arrays = arrays
        self._engine = engine
        self._conn = conn
        self._deadline = deadline
        self._done = False

    def wait(self) -> None:
        if self._done:
            raise RuntimeError("PendingPull.wait() called twice")
        self._done = True
        err = _wait_ready(self.arrays, self._deadline, self._engine._clock)
        self._engine._finish(self._conn, failed=err is not None)
        if err == "timeout":
            raise PullTimeout(f"pull of uuid {self.uuid} from {self.peer} not ready by deadline")
        if err is not None:
            raise PullError(f"pull of uuid {self.uuid} from {self.peer} failed: {err}")


class JaxTransferKVEngine(KVTransferEngine):
    """KV transfer over ``jax.experimental.transfer``; see the module docstring."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        transfer_size: int = DEFAULT_TRANSFER_SIZE,
        max_num_parallel_copies: int = 8,
        use_raw_buffers: bool = True,
        transport_streams: int = DEFAULT_TRANSPORT_STREAMS,
        device: jax.Device | None = None,
        reaper_interval_s: float | None = 0.5,
        release_verify_s: float = 2.0,
        on_release: Callable[[ReleaseResult], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # This process's first device (in an instance spanning processes, jax.devices()[0] is
        # rank 0's, which no other process can put a placeholder on).
        self._device = device if device is not None else jax.local_devices()[0]
        self._sharding = jax.sharding.SingleDeviceSharding(self._device)
        if transport_streams < 1:
            raise ValueError("transport_streams must be >= 1")
        self._server = transfer.start_transfer_server(
            self._device.client,
            f"{host}:0",
            [f"{host}:0"] * transport_streams,
            max_num_parallel_copies=max_num_parallel_copies,
            transfer_size=transfer_size,
            use_raw_buffers=use_raw_buffers,
        )
        self._address: str = self._server.address()
        self._clock = clock
        self._release_verify_s = release_verify_s
        self._on_release = on_release
        self._lock = threading.Lock()  # guards _conns, _regs and _Conn counters
        self._release_lock = threading.Lock()  # one release at a time: shares the self-connection
        self._conns: dict[str, _Conn] = {}
        # Retired connections with pulls still on them (poisoned when the last one ends, or at
        # once by drop_connection).
        self._retired: list[_Conn] = []
        self._regs: dict[int, _Registration] = {}
        self._self_conn: _Conn | None = None
        self._closed = threading.Event()
        self._reaper: threading.Thread | None = None
        if reaper_interval_s is not None:
            self._reaper = threading.Thread(
                target=self._reap_loop, args=(reaper_interval_s,), name="kv-lease-reaper",
                daemon=True,
            )
            self._reaper.start()

    @property
    def address(self) -> str:
        return self._address

    @property
    def sharding(self) -> jax.sharding.Sharding:
        """The device this engine's own placeholders live on."""
        return self._sharding

    # sender side --------------------------------------------------------------------------------

    def register(self, uuid: int, arrays: Sequence[jax.Array], lease_s: float) -> None:
        if not 0 <= uuid < UUID_LIMIT:
            raise ValueError(f"uuid {uuid} does not fit uint64")
        arrays = list(arrays)
        if not arrays:
            raise ValueError("nothing to register")
        nbytes = sum(int(a.nbytes) for a in arrays)
        with self._lock:
            if self._closed.is_set():
                raise RuntimeError("engine closed")
            if uuid in self._regs:
                # Re-registering would silently replace the entry a peer may be about to pull.
                raise ValueError(f"uuid {uuid} is already registered")
            self._regs[uuid] = _Registration(uuid, nbytes, self._clock() + lease_s)
        try:
            self._server.await_pull(uuid, arrays)
        except Exception:
            with self._lock:
                self._regs.pop(uuid, None)
            raise

    def extend_lease(self, uuid: int, lease_s: float) -> bool:
        with self._lock:
            reg = self._regs.get(uuid)
            if reg is None:
                return False
            reg.expires_at = max(reg.expires_at, self._clock() + lease_s)
            return True

    def registrations(self) -> Mapping[int, int]:
        with self._lock:
            return {u: r.nbytes for u, r in self._regs.items()}

    def release(self, uuid: int, reason: str) -> ReleaseResult:
        start = self._clock()
        with self._lock:
            reg = self._regs.pop(uuid, None)
        if reg is None:
            return ReleaseResult(uuid, False, False, f"not registered ({reason})", 0, 0.0)
        with self._release_lock:
            verified, why = self._replace_and_consume(uuid)
        if not verified:
            log.warning("release of uuid %d not verified: %s", uuid, why)
        result = ReleaseResult(
            uuid, True, verified, f"{reason}; {why}", reg.nbytes, self._clock() - start
        )
        if self._on_release is not None:
            try:
                self._on_release(result)
            except Exception:
                log.exception("release callback")
        return result

    def _replace_and_consume(self, uuid: int) -> tuple[bool, str]:
        nonce = new_uuid()
        marker_np = np.array(
            [uuid & 0xFFFFFFFF, uuid >> 32, nonce & 0xFFFFFFFF, nonce >> 32], dtype=np.uint32
        )
        marker = jax.device_put(marker_np, self._sharding)
        marker.block_until_ready()
        # Step 1: replacing the entry frees the registered buffers.
        self._server.await_pull(uuid, [marker], timeout=_library_timeout(self._release_verify_s))
        # Step 2: consume the placeholder ourselves; seeing our marker proves the replacement.
        conn = self._own_connection()
        spec = jax.ShapeDtypeStruct(marker_np.shape, jnp.uint32, sharding=self._sharding)
        try:
            (got,) = conn.conn.pull(uuid, [spec], timeout=_library_timeout(self._release_verify_s))
        except Exception as e:
            self._finish(conn, failed=True)
            return False, f"self-pull refused: {e}"
        err = _wait_ready([got], self._clock() + self._release_verify_s, self._clock)
        self._finish(conn, failed=err is not None)
        if err is not None:
            return False, f"placeholder not consumed ({err})"
        if not np.array_equal(np.asarray(got), marker_np):
            return False, "self-pull returned a foreign placeholder"
        return True, "verified gone"

    def reap_expired(self) -> list[ReleaseResult]:
        now = self._clock()
        with self._lock:
            expired = [u for u, r in self._regs.items() if r.expires_at <= now]
        return [self.release(u, "lease expired") for u in expired]

    def _reap_loop(self, interval: float) -> None:
        while not self._closed.wait(interval):
            try:
                for res in self.reap_expired():
                    log.info("lease expired: %s", res)
            except Exception:
                log.exception("lease reaper")

    # receiver side ------------------------------------------------------------------------------

    def start_pull(
        self, peer: str, uuid: int, specs: Sequence[jax.ShapeDtypeStruct], deadline_s: float
    ) -> PendingPull:
        if not 0 <= uuid < UUID_LIMIT:
            raise ValueError(f"uuid {uuid} does not fit uint64")
        deadline = self._clock() + deadline_s
        conn = self._connection(peer, min(_PROBE_S, deadline_s))
        try:
            arrays = conn.conn.pull(uuid, list(specs), timeout=_library_timeout(deadline_s))
        except Exception as e:
            self._finish(conn, failed=True)
            raise PullError(f"pull of uuid {uuid} from {peer} refused: {e}") from e
        return _JaxPendingPull(self, conn, uuid, list(arrays), deadline)

    def _connection(self, peer: str, probe_s: float) -> _Conn:
        """The cached connection to ``peer``, or a new one once a probe found it listening."""
        with self._lock:
            known = peer in self._conns
        if not known:
            why = refused(peer, probe_s)
            if why:
                raise PullError(f"nothing listens at {peer} (P's transfer server is gone): {why}")
        with self._lock:
            if self._closed.is_set():
                raise RuntimeError("engine closed")
            c = self._conns.get(peer)
            if c is None:
                c = _Conn(peer, self._server.connect(peer))
                self._conns[peer] = c
            c.inflight += 1
            return c

    def _own_connection(self) -> _Conn:
        with self._lock:
            if self._self_conn is None or self._self_conn.retired:
                self._self_conn = _Conn(self._address, self._server.connect(self._address))
            self._self_conn.inflight += 1
            return self._self_conn

    def _finish(self, c: _Conn, failed: bool) -> None:
        """One pull on ``c`` is over. A failure retires ``c``; a retired connection is poisoned once
        its last pull is over, so that pulls we abandoned fail instead of hanging forever."""
        with self._lock:
            c.inflight -= 1
            if failed and not c.retired:
                self._retire(c)
            poison = c.retired and c.inflight == 0 and not c.poisoned
            if poison:
                c.poisoned = True
                self._retired.remove(c)
        if poison:
            _poison(c)

    def _retire(self, c: _Conn) -> None:
        """No new pull goes on ``c`` (under ``_lock``)."""
        c.retired = True
        if self._conns.get(c.peer) is c:
            del self._conns[c.peer]
        self._retired.append(c)

    def drop_connection(self, peer: str, reason: str) -> None:
        """Every connection to ``peer`` poisoned now, those with pulls in flight too: each such
        pull fails at once (a pull blocked on a dead or hung P would wait until its deadline),
        and the next pull connects afresh."""
        with self._lock:
            c = self._conns.get(peer)
            if c is not None:
                self._retire(c)
            dropped = [c for c in self._retired if c.peer == peer]
            for c in dropped:
                c.poisoned = True
                self._retired.remove(c)
        if dropped:
            log.info("dropped %d connection(s) to %s (%d pull(s) on them): %s", len(dropped),
                     peer, sum(c.inflight for c in dropped), reason)
        for c in dropped:
            _poison(c)

    def close(self) -> None:
        self._closed.set()
        if self._reaper is not None:
            self._reaper.join(timeout=5)
        for u in list(self.registrations()):
            self.release(u, "engine closed")
        with self._lock:
            peers = {*self._conns, *(c.peer for c in self._retired)}
        for p in sorted(peers):
            self.drop_connection(p, "engine closed")
