"""The P↔D side channel: pyzmq sockets driven from trio, carrying the core's wire frames.

P binds one ROUTER at its ``zmq_addr``; D opens one DEALER per P, whose routing id is D's
identity (the ``reply_to`` in RECV_INIT and the ``peer`` P's core sees). No thread per socket:
each socket has one reader task that waits on ``zmq.FD`` with ``trio.lowlevel.wait_readable`` and
drains while ``zmq.EVENTS`` says POLLIN. That FD is edge-triggered and any send or recv on the
socket may consume the edge, so the reader re-checks EVENTS before every wait and a send pokes
the reader when it finds input pending.

Everything is bounded so a dead or hostile peer cannot grow memory: HWMs on both directions,
non-blocking sends that count a drop on EAGAIN, ``MAXMSGSIZE`` (libzmq drops a connection that
sends more, counted as a disconnect by the socket monitor), the codec's ``MAX_FRAME``, and a
bounded inbox behind ``deliver``: the ``EndpointDriver``'s waits when full (the reader stops
reading and zmq pushes back to the sender's HWM), the worker's drops and counts
(``inbox_dropped_total``: a step can take seconds, and liveness frames must not queue behind
it).
Malformed, unsigned or wrongly signed frames are counted and dropped; the socket keeps working.
With a cluster secret, frames are signed with the side-channel key derived from it
(:func:`pd_fsm.core.keys.side_channel_key`; the secret itself is never used as a key nor sent),
every frame is also stamped with the sender's wall-clock time and a nonce, and the receiver drops
(and counts) frames outside its replay window, seen before, or sent before this channel was
created (a restart does not reopen the window: :mod:`pd_fsm.core.replay`). P's and D's clocks
must agree (NTP).
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import attrs
import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from pd_fsm.core.codec import MAX_FRAME, decode, encode
from pd_fsm.core.errors import RemoteProtocolError
from pd_fsm.core.keys import side_channel_key
from pd_fsm.core.messages import Message
from pd_fsm.core.replay import DEFAULT_WINDOW_S, ReplayedFrame, ReplayGuard, StaleFrame
from pd_fsm.io_trio.side_channel.curve import ZAP_ENDPOINT, CurveKeys, zap_reply
from pd_fsm.io_trio.unix_sockets import DEFAULT_MODE, file_id, ipc_path, prepare_ipc, remove_if

log = logging.getLogger("pd_fsm.io_trio.side_channel.channel")

Deliver = Callable[[str, Message], Awaitable[None]]


@attrs.frozen
class SideChannelLimits:
    max_frame: int = MAX_FRAME  # larger frames are counted as oversized and dropped
    # libzmq's own cap: a message above it makes libzmq drop the sender's connection, so a
    # peer cannot make us buffer a huge message before our own size check sees it.
    max_msg_size: int = MAX_FRAME + 4096
    sndhwm: int = 10_000  # messages queued per peer before sends fail with EAGAIN (dropped)
    rcvhwm: int = 10_000
    # IMMEDIATE=1 would refuse sends until a DEALER's TCP connection is up, which drops the
    # first RECV_INIT to every newly resolved P. The HWM bounds the queue to a dead P instead
    # (and the core stops talking to a P after peer_timeout).
    immediate: bool = False
    batch: int = 256  # frames drained per wake-up before yielding to other tasks
    # Signed frames: how far the sender's clock may be from ours, and how long a MAC is
    # remembered to refuse a replay (pd_fsm.core.replay).
    replay_window_s: float = DEFAULT_WINDOW_S


@attrs.define
class SideChannelStats:
    received: int = 0
    sent: int = 0
    malformed: int = 0  # codec refused it: garbage, bad version, bad fields, bad/missing MAC
    stale: int = 0  # signed, but sent outside the replay window (a late replay, or clock skew)
    replayed: int = 0  # signed, and its MAC was already accepted: a replay
    oversized: int = 0  # over max_frame
    wrong_parts: int = 0  # not the multipart shape this socket type carries
    send_full: int = 0  # EAGAIN: the peer's queue is at the HWM (or no connection yet)
    send_unroutable: int = 0  # ROUTER: no connected peer has that identity
    disconnects: int = 0  # connections libzmq closed (peer left, protocol error, over MAXMSGSIZE)
    curve_refused: int = 0  # P: CURVE handshakes refused (client key not trusted), by ZAP
    # Handshakes libzmq failed: another security mechanism (a plain client of a CURVE server),
    # a bad CURVE exchange, or a ZAP refusal (also counted above).
    handshake_failed: int = 0
    curve_untrusted_server: int = 0  # D: P's registry key missing or not trusted: not dialled

    def as_dict(self) -> dict[str, int]:
        return attrs.asdict(self)


def frame_now(message: Message, key: bytes | None) -> bytes:
    """The wire frame for ``message``, signed with ``key`` (the side-channel key, not the cluster
    secret) when given; signed frames are stamped with now and a fresh nonce."""
    if key is None:
        return encode(message)
    return encode(message, key, sent_at=time.time(), nonce=secrets.randbits(64))


def zmq_endpoint(addr: str) -> str:
    """ "host:port" → "tcp://host:port"; full zmq endpoints pass through."""
    return addr if "://" in addr else f"tcp://{addr}"


def _configure(sock: zmq.Socket[Any], limits: SideChannelLimits) -> None:
    sock.setsockopt(zmq.LINGER, 0)  # closing never blocks on a dead peer
    sock.setsockopt(zmq.SNDHWM, limits.sndhwm)
    sock.setsockopt(zmq.RCVHWM, limits.rcvhwm)
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_msg_size)


# Refusals the stats count apart from "malformed" (a stats field of the same name each).
_DROP_KINDS: dict[type[RemoteProtocolError], str] = {StaleFrame: "stale", ReplayedFrame: "replayed"}


def _log_drop(count: int, kind: str, peer: str, detail: str) -> None:
    # Every drop is counted; the log gets the 1st, 2nd, 4th, 8th, ... so a flood of garbage
    # stays visible without becoming a flood of log lines.
    if count & (count - 1) == 0:
        log.warning("dropped %s frame #%d from %r: %s", kind, count, peer, detail)


_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def _readable(sock: zmq.Socket[Any]) -> bool:
    return bool(cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


def _fd(sock: zmq.Socket[Any]) -> int:
    return cast(int, sock.getsockopt(zmq.FD))


class _Pump:
    """Reads one zmq socket from trio without a thread (see the module docstring)."""

    def __init__(
        self,
        sock: zmq.Socket[Any],
        on_parts: Callable[[list[bytes]], Awaitable[None]],
        batch: int,
    ) -> None:
        self.sock = sock
        self._on_parts = on_parts
        self._batch = batch
        self._waiting: trio.CancelScope | None = None

    def poke(self) -> None:
        """Call after a send on this socket: it may have swallowed the FD's edge."""
        if self._waiting is not None and _readable(self.sock):
            self._waiting.cancel()

    async def run(self) -> None:
        sock = self.sock
        fd = _fd(sock)
        try:
            while True:
                drained = 0
                while _readable(sock):
                    try:
                        parts = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    await self._on_parts(parts)
                    drained += 1
                    if drained >= self._batch:  # a flood must not starve the other tasks
                        drained = 0
                        await trio.lowlevel.checkpoint()
                with trio.CancelScope() as scope:
                    self._waiting = scope
                    if not _readable(sock):
                        await trio.lowlevel.wait_readable(fd)
                self._waiting = None
        finally:
            self._waiting = None


def _close(sock: zmq.Socket[Any]) -> None:
    if not sock.closed:
        trio.lowlevel.notify_closing(_fd(sock))  # trio forgets the fd first
        sock.close(linger=0)


class _Channel:
    """What both ends share: the codec, the stats, the monitor. ``secret`` is the cluster
    secret; frames are signed and checked with :func:`~pd_fsm.core.keys.side_channel_key` of it."""

    def __init__(self, deliver: Deliver, secret: bytes | None, limits: SideChannelLimits,
                 curve: CurveKeys | None = None) -> None:
        self._deliver = deliver
        self.curve = curve
        # Only the derived key is kept: the cluster secret signs nothing here.
        self._key = side_channel_key(secret) if secret else None
        # Floor at our own start: frames captured before a restart are not replayable to us.
        self.started_at = time.time()
        self._guard = (
            ReplayGuard(limits.replay_window_s, not_before=self.started_at)
            if self._key is not None
            else None
        )
        self.limits = limits
        self.stats = SideChannelStats()
        self._ctx = zmq.Context()
        self._monitors = 0

    async def _accept(self, peer: str, frame: bytes) -> None:
        if len(frame) > self.limits.max_frame:
            self.stats.oversized += 1
            _log_drop(self.stats.oversized, "oversized", peer, f"{len(frame)} bytes")
            return
        try:
            message = decode(frame, self._key, guard=self._guard, now=time.time())
        except RemoteProtocolError as exc:
            kind = _DROP_KINDS.get(type(exc), "malformed")
            count = getattr(self.stats, kind) + 1
            setattr(self.stats, kind, count)
            _log_drop(count, kind, peer, str(exc))
            return
        self.stats.received += 1
        await self._deliver(peer, message)

    def _open(self, kind: int) -> tuple[zmq.Socket[Any], zmq.Socket[Any]]:
        """A configured socket and the PAIR reading its monitor events. Call before bind or
        connect, so no event can be emitted before the reader is connected."""
        sock = self._ctx.socket(kind)
        _configure(sock, self.limits)
        self._monitors += 1
        address = f"inproc://pd-fsm-monitor-{id(self)}-{self._monitors}"
        sock.monitor(address, zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED)
        reader = self._ctx.socket(zmq.PAIR)
        reader.setsockopt(zmq.LINGER, 0)
        # libzmq's I/O thread sends monitor events with a blocking send while holding the
        # monitor lock; an unbounded pipe (RCVHWM 0) means it can never block on us, so
        # disable_monitor below can never deadlock with it.
        reader.setsockopt(zmq.RCVHWM, 0)
        reader.connect(address)
        return sock, reader

    async def _serve(self, pump: _Pump, monitor: zmq.Socket[Any]) -> None:
        """Run a socket's reader and its monitor's reader; close both in a safe order."""

        async def on_event(parts: list[bytes]) -> None:
            event = parse_monitor_message(parts)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self.stats.disconnects += 1
            elif event & _HANDSHAKE_FAILED:
                self.stats.handshake_failed += 1

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump.run)
                nursery.start_soon(_Pump(monitor, on_event, self.limits.batch).run)
        finally:
            # Stop the monitor while its reader is still connected (see _open), then close.
            if not pump.sock.closed:
                pump.sock.disable_monitor()
            _close(monitor)
            _close(pump.sock)

    def _send(self, sock: zmq.Socket[Any], parts: list[bytes]) -> bool:
        try:
            sock.send_multipart(parts, zmq.NOBLOCK)
        except zmq.Again:
            self.stats.send_full += 1
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self.stats.send_unroutable += 1
            return False
        self.stats.sent += 1
        return True


class PrefillSideChannel(_Channel):
    """P's ROUTER. ``await nursery.start(ch.run)`` returns the bound endpoint
    (``tcp://127.0.0.1:PORT``; bind to port 0 for an ephemeral one)."""

    def __init__(
        self,
        bind_addr: str,
        deliver: Deliver,
        *,
        secret: bytes | None = None,
        limits: SideChannelLimits | None = None,
        curve: CurveKeys | None = None,
        ipc_mode: int = DEFAULT_MODE,
    ) -> None:
        """``bind_addr``: "host:port" (TCP) or an ``ipc://PATH`` endpoint, whose socket file
        gets ``ipc_mode`` (unix_sockets.py: a live one there is refused, a stale one replaced)."""
        super().__init__(deliver, secret, limits or SideChannelLimits(), curve)
        self.bind_addr = bind_addr
        self.ipc_mode = ipc_mode
        self.address: str | None = None
        self._pump: _Pump | None = None

    async def run(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        ipc = ipc_path(self.bind_addr)
        bound: tuple[int, int] | None = None
        if ipc is not None:  # libzmq would take the path from a live P: refused here instead
            await trio.to_thread.run_sync(prepare_ipc, self.bind_addr)
        zap = self._zap_socket() if self.curve is not None else None
        sock, monitor = self._open(zmq.ROUTER)
        try:
            if self.curve is not None:
                self.curve.make_server(sock)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown identity: EHOSTUNREACH, counted
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted D reclaims its identity
            endpoint = zmq_endpoint(self.bind_addr)
            if endpoint.endswith(":0"):
                endpoint = endpoint[:-2] + ":*"
            sock.bind(endpoint)
            if ipc is not None:
                os.chmod(ipc, self.ipc_mode)
                bound = file_id(ipc)
        except BaseException:
            _close(monitor)
            _close(sock)
            if zap is not None:
                _close(zap)
            self._ctx.destroy(linger=0)
            raise
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._pump = _Pump(sock, self._on_parts, self.limits.batch)
        task_status.started(self.address)
        try:
            async with trio.open_nursery() as nursery:
                if zap is not None:
                    nursery.start_soon(self._serve_zap, zap)
                await self._serve(self._pump, monitor)
                nursery.cancel_scope.cancel()
        finally:
            self._pump = None
            if zap is not None:
                _close(zap)
            self._ctx.destroy(linger=0)
            if ipc is not None:  # libzmq may leave the file: ours to remove, if still ours
                remove_if(ipc, bound)

    def _zap_socket(self) -> zmq.Socket[Any]:
        """The ZAP handler's socket, bound before the ROUTER so no handshake goes unchecked."""
        zap = self._ctx.socket(zmq.REP)
        zap.setsockopt(zmq.LINGER, 0)
        zap.bind(ZAP_ENDPOINT)
        return zap

    async def _serve_zap(self, zap: zmq.Socket[Any]) -> None:
        """Answer libzmq's ZAP requests: admit a D whose CURVE key is trusted, refuse and count
        any other. Runs on the loop (a REP answers before its next request is read)."""
        assert self.curve is not None
        keys = self.curve

        async def on_request(parts: list[bytes]) -> None:
            reply, admitted = zap_reply(parts, keys)
            if not admitted:
                self.stats.curve_refused += 1
                _log_drop(self.stats.curve_refused, "CURVE handshake", "?", "key not trusted")
            zap.send_multipart(reply)

        await _Pump(zap, on_request, self.limits.batch).run()

    async def _on_parts(self, parts: list[bytes]) -> None:
        if len(parts) != 2:  # [identity, frame] from a DEALER; anything else is not ours
            self.stats.wrong_parts += 1
            _log_drop(self.stats.wrong_parts, "misshapen", "?", f"{len(parts)} parts")
            return
        # surrogateescape: any routing id round-trips to the same bytes when we answer it.
        await self._accept(parts[0].decode("utf-8", "surrogateescape"), parts[1])

    def close_peer(self, peer: str) -> bool:
        """Nothing to close: one ROUTER socket serves every D (the core of P never forgets a
        peer this way; the method makes both sides one ``driver.SideChannel``)."""
        return False

    def send(self, peer: str, message: Message) -> bool:
        pump = self._pump
        if pump is None:
            self.stats.send_unroutable += 1
            return False
        identity = peer.encode("utf-8", "surrogateescape")
        ok = self._send(pump.sock, [identity, frame_now(message, self._key)])
        pump.poke()
        return ok


class DecodeSideChannel(_Channel):
    """D's DEALERs, one per P (``peer`` = P's zmq_addr as the bootstrap server gave it),
    opened on the first send to that P."""

    def __init__(
        self,
        identity: str,
        deliver: Deliver,
        *,
        secret: bytes | None = None,
        limits: SideChannelLimits | None = None,
        curve: CurveKeys | None = None,
    ) -> None:
        super().__init__(deliver, secret, limits or SideChannelLimits(), curve)
        # With CURVE: P's public key per peer address, from its registry record (set_server_key).
        self._server_keys: dict[str, bytes] = {}
        if not identity or len(identity.encode()) > 255 or identity.startswith("\0"):
            raise ValueError("identity must be 1..255 bytes and not start with NUL (zmq rule)")
        self.identity = identity
        self._pumps: dict[str, _Pump] = {}
        self._scopes: dict[str, trio.CancelScope] = {}
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            self._pumps.clear()  # each _serve task closed its sockets when it was cancelled
            self._scopes.clear()
            self._ctx.destroy(linger=0)

    def set_server_key(self, peer: str, public_z85: str | None) -> str | None:
        """With CURVE, remember the key ``peer`` (a P) published; the reason it cannot be
        dialled (no key, or one not among ours), counted, or None. Without CURVE: None."""
        if self.curve is None:
            return None
        if not public_z85 or not self.curve.trusts(public_z85):
            self.stats.curve_untrusted_server += 1
            what = "published no CURVE key" if not public_z85 else "has a CURVE key not trusted"
            return f"prefill side channel {peer} {what} (--side-channel-curve-peers)"
        key = public_z85.encode()
        if self._server_keys.get(peer, key) != key:
            self.close_peer(peer)  # a new P at that address: the old DEALER has the old key
        self._server_keys[peer] = key
        return None

    @property
    def peers(self) -> list[str]:
        return list(self._pumps)

    def close_peer(self, peer: str) -> bool:
        """Close the DEALER to ``peer`` (a P that is gone for good), dropping what is queued for
        it; a later send opens a fresh one. False if there was none."""
        scope = self._scopes.pop(peer, None)
        self._pumps.pop(peer, None)
        if scope is None:
            return False
        scope.cancel()
        return True

    async def _serve_peer(
        self, scope: trio.CancelScope, pump: _Pump, monitor: zmq.Socket[Any]
    ) -> None:
        with scope:
            await self._serve(pump, monitor)

    def connect(self, peer: str) -> bool:
        """Open the DEALER to ``peer`` now (optional: ``send`` does it on first use)."""
        return self._pump_for(peer) is not None

    def _pump_for(self, peer: str) -> _Pump | None:
        pump = self._pumps.get(peer)
        if pump is not None:
            return pump
        if self._nursery is None:
            return None
        server_key = self._server_keys.get(peer)
        if self.curve is not None and server_key is None:
            self.stats.curve_untrusted_server += 1
            return None  # never dial a P whose key we have not checked
        sock, monitor = self._open(zmq.DEALER)
        if self.curve is not None and server_key is not None:
            self.curve.make_client(sock, server_key)
        sock.setsockopt(zmq.IMMEDIATE, int(self.limits.immediate))
        sock.setsockopt(zmq.ROUTING_ID, self.identity.encode())
        try:
            sock.connect(zmq_endpoint(peer))
        except zmq.ZMQError as exc:
            sock.disable_monitor()
            _close(monitor)
            _close(sock)
            log.warning("cannot connect to prefill side channel %r: %s", peer, exc)
            return None

        async def on_parts(parts: list[bytes]) -> None:
            if len(parts) != 1:  # a DEALER receives the ROUTER's frame without the identity
                self.stats.wrong_parts += 1
                _log_drop(self.stats.wrong_parts, "misshapen", peer, f"{len(parts)} parts")
                return
            await self._accept(peer, parts[0])

        pump = _Pump(sock, on_parts, self.limits.batch)
        self._pumps[peer] = pump
        scope = self._scopes[peer] = trio.CancelScope()
        self._nursery.start_soon(self._serve_peer, scope, pump, monitor)
        return pump

    def send(self, peer: str, message: Message) -> bool:
        pump = self._pump_for(peer)
        if pump is None:
            self.stats.send_unroutable += 1
            return False
        ok = self._send(pump.sock, [frame_now(message, self._key)])
        pump.poke()
        return ok
