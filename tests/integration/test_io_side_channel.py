"""The side channel under abuse, on real ZMQ sockets: garbage, unsigned, wrongly signed (the
registry's key and the cluster secret itself included), stale, replayed (across a restart too),
oversized and misshapen frames are counted and dropped, raw TCP garbage is survived, sends to a
dead peer are bounded, and the socket keeps working after each. Nothing either end sends holds
the cluster secret or a key."""

from __future__ import annotations

import base64
import contextlib
import time
from pathlib import Path
from typing import Any

import pytest
import trio
import zmq
import zmq.auth

from pd_fsm.core.codec import MAX_FRAME, decode, encode
from pd_fsm.core.keys import registry_key, side_channel_key
from pd_fsm.core.messages import Abort, Heartbeat, HeartbeatAck, Message
from pd_fsm.io_trio.side_channel.channel import (
    DecodeSideChannel,
    PrefillSideChannel,
    SideChannelLimits,
    frame_now,
)
from pd_fsm.io_trio.side_channel.curve import CurveError, CurveKeys
from tests.support.io_doubles import Inbox
from tests.support.io_doubles import until as _until

SECRET = b"cluster-secret-for-the-side-channel-tests"
KEY = side_channel_key(SECRET)  # what the channels sign with, given SECRET
GOOD = Heartbeat(seq=1, rooms=(1, 2, 3))


@pytest.fixture
def ctx() -> Any:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _raw_dealer(ctx: zmq.Context[Any], address: str, identity: bytes) -> zmq.Socket[Any]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 5000)  # a send with no peer pipe blocks: bounded, raises
    sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.connect(address)
    return sock


async def _start_p(
    nursery: trio.Nursery, inbox: Inbox, **kw: Any
) -> tuple[PrefillSideChannel, str]:
    p = PrefillSideChannel("127.0.0.1:0", inbox.deliver, secret=SECRET, **kw)
    address: str = await nursery.start(p.run)
    return p, address


async def test_p_counts_and_drops_bad_frames(nursery: trio.Nursery, ctx: Any) -> None:
    inbox = Inbox()
    p, address = await _start_p(nursery, inbox)
    rogue = _raw_dealer(ctx, address, b"rogue")
    good = frame_now(GOOD, KEY)
    bad = [
        [b"\x00garbage"],  # not a pd_fsm frame
        [encode(GOOD)],  # unsigned, but this side has a secret
        [frame_now(GOOD, b"wrong")],  # wrongly signed
        [frame_now(GOOD, registry_key(SECRET))],  # this cluster's registry key: not for frames
        [frame_now(GOOD, SECRET)],  # the cluster secret itself is no key either
        [good[:-1] + bytes([good[-1] ^ 0xFF])],  # MAC tampered with (flipped: never equal)
        [good[:3]],  # truncated
        [b"x" * (MAX_FRAME + 10)],  # over MAX_FRAME, under MAXMSGSIZE
        [b"a", b"b"],  # three parts at the ROUTER
        [b""],  # empty
        [encode(GOOD, KEY, sent_at=time.time() - 3600, nonce=1)],  # signed an hour ago
        [encode(GOOD, KEY, sent_at=time.time() + 3600, nonce=2)],  # an hour ahead
    ]
    for parts in bad:
        rogue.send_multipart(parts)
    rogue.send_multipart([good])  # and then a good one ...
    await _until(lambda: inbox.got)
    rogue.send_multipart([good])  # ... replayed
    await _until(lambda: p.stats.replayed)
    s = p.stats

    def counts() -> tuple[int, ...]:
        return (s.malformed, s.oversized, s.wrong_parts, s.stale, s.replayed, s.received)

    # Refusals are counted as the pump reads them; wait for the last (rarely, one lags).
    with trio.move_on_after(5):
        await _until(lambda: counts() == (8, 1, 1, 2, 1, 1))
    assert counts() == (8, 1, 1, 2, 1, 1)
    assert inbox.got == [("rogue", GOOD)]

    # P answers the rogue's identity; an identity nobody holds is counted, not raised.
    assert p.send("rogue", HeartbeatAck(incarnation=1, seq=1))
    assert not p.send("nobody", HeartbeatAck(incarnation=1, seq=1))
    assert p.stats.send_unroutable == 1
    await _until(lambda: rogue.poll(0))
    assert decode(rogue.recv_multipart(zmq.NOBLOCK)[0], KEY) == HeartbeatAck(1, 1)
    rogue.close()


async def test_over_maxmsgsize_drops_the_connection_not_the_socket(
    nursery: trio.Nursery, ctx: Any
) -> None:
    inbox = Inbox()
    limits = SideChannelLimits(max_msg_size=MAX_FRAME + 1024)
    p, address = await _start_p(nursery, inbox, limits=limits)
    huge = _raw_dealer(ctx, address, b"huge")
    huge.send(b"z" * (4 * MAX_FRAME))  # libzmq refuses it and closes that connection
    await _until(lambda: p.stats.disconnects >= 1)
    assert p.stats.received == 0
    honest = _raw_dealer(ctx, address, b"honest")
    honest.send(frame_now(GOOD, KEY))
    await _until(lambda: inbox.got)
    assert inbox.got == [("honest", GOOD)]
    huge.close()
    honest.close()


async def test_raw_tcp_garbage_is_survived(nursery: trio.Nursery, ctx: Any) -> None:
    inbox = Inbox()
    p, address = await _start_p(nursery, inbox)
    port = int(address.rsplit(":", 1)[1])
    for payload in (b"GET / HTTP/1.1\r\n\r\n", bytes(range(256)) * 64, b"\xff" * 10):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        try:
            await stream.send_all(payload)
            with trio.move_on_after(0.2):
                await stream.receive_some(1024)
        except trio.BrokenResourceError:
            pass  # libzmq hung up on us: the point
        finally:
            await stream.aclose()
    ok = _raw_dealer(ctx, address, b"after")
    ok.send(frame_now(GOOD, KEY))
    await _until(lambda: inbox.got)
    assert inbox.got == [("after", GOOD)] and p.stats.received == 1
    ok.close()


async def test_d_counts_garbage_from_a_rogue_p(nursery: trio.Nursery, ctx: Any) -> None:
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    peer = f"127.0.0.1:{port}"
    inbox = Inbox()
    d = DecodeSideChannel("decode-7", inbox.deliver, secret=SECRET)
    await nursery.start(d.run)
    assert d.send(peer, GOOD)  # opens the DEALER; the rogue P learns our identity
    await _until(lambda: router.poll(0))
    identity, frame = router.recv_multipart(zmq.NOBLOCK)
    assert identity == b"decode-7" and decode(frame, KEY) == GOOD
    for parts in ([b"junk"], [encode(Abort(1, "x"))], [b"a", b"b"], [b"y" * (MAX_FRAME + 1)]):
        router.send_multipart([identity, *parts])
    router.send_multipart([identity, frame_now(Abort(1, "real"), KEY)])
    await _until(lambda: inbox.got)
    assert inbox.got == [(peer, Abort(1, "real"))]
    s = d.stats
    assert (s.malformed, s.wrong_parts, s.oversized, s.received) == (2, 1, 1, 1)
    router.close()


async def test_sends_to_a_dead_peer_are_bounded(nursery: trio.Nursery) -> None:
    inbox = Inbox()
    limits = SideChannelLimits(sndhwm=10)
    d = DecodeSideChannel("decode-8", inbox.deliver, limits=limits)
    await nursery.start(d.run)
    # Nothing listens there: frames queue up to the HWM, then each send is a counted drop.
    with trio.socket.socket() as probe:
        await probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
    results = [d.send(dead, GOOD) for _ in range(500)]
    assert results.count(True) <= 50 and d.stats.send_full == results.count(False) >= 450
    assert d.stats.sent == results.count(True)


async def test_immediate_refuses_until_connected(nursery: trio.Nursery) -> None:
    inbox = Inbox()
    d = DecodeSideChannel("decode-9", inbox.deliver, limits=SideChannelLimits(immediate=True))
    await nursery.start(d.run)
    with trio.socket.socket() as probe:
        await probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
    assert not d.send(dead, GOOD) and d.stats.send_full == 1
    p_inbox = Inbox()
    p = PrefillSideChannel("127.0.0.1:0", p_inbox.deliver)
    address = await nursery.start(p.run)
    d.connect(address)
    await trio.sleep(0.2)  # IMMEDIATE: only once the TCP connection is up
    assert d.send(address, GOOD)
    await _until(lambda: p_inbox.got)


async def test_round_trip_under_load_and_clean_shutdown(nursery: trio.Nursery) -> None:
    """Many frames both ways with the edge-triggered FD: nothing lost, nothing stuck."""
    n = 3000
    p_in, d_in = Inbox(), Inbox()

    async def echo(peer: str, message: Message) -> None:
        p_in.got.append((peer, message))
        p.send(peer, HeartbeatAck(incarnation=9, seq=len(p_in.got)))

    p = PrefillSideChannel("127.0.0.1:0", echo, secret=SECRET)
    address = await nursery.start(p.run)
    scope = trio.CancelScope()
    d = DecodeSideChannel("decode-1", d_in.deliver, secret=SECRET)

    async def run_d(*, task_status: trio.TaskStatus[None]) -> None:
        with scope:
            await d.run(task_status=task_status)

    await nursery.start(run_d)
    for i in range(n):
        assert d.send(address, Heartbeat(seq=i, rooms=tuple(range(64))))
        if i % 500 == 0:
            await trio.sleep(0)
    await _until(lambda: len(d_in.got) == n, timeout=20)
    assert [m.seq for _, m in d_in.got] == list(range(1, n + 1))  # type: ignore[union-attr]
    scope.cancel()
    await _until(lambda: p.stats.disconnects >= 1)  # D closed its DEALER on the way out


async def test_close_peer_frees_its_dealer(nursery: trio.Nursery) -> None:
    d = DecodeSideChannel("decode-10", Inbox().deliver, limits=SideChannelLimits(sndhwm=10))
    await nursery.start(d.run)
    with trio.socket.socket() as probe:
        await probe.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{probe.getsockname()[1]}"
    for _ in range(50):
        d.send(dead, GOOD)
    assert d.peers == [dead] and d.stats.send_full > 0
    assert d.close_peer(dead) and not d.close_peer(dead)
    assert d.peers == []
    await trio.sleep(0.05)  # its task closes the socket and the queued frames with it
    full = d.stats.send_full
    assert d.send(dead, GOOD) and d.stats.send_full == full  # a fresh, empty DEALER


async def test_frames_from_before_a_restart_are_refused(nursery: trio.Nursery, ctx: Any) -> None:
    """A restarted P remembers no MAC it accepted before; frames captured then (here: D's real
    frames, as the first P saw them) are still inside the 60 s window, yet refused as stale
    because they were sent before the new P started. The new D frames after it pass."""
    router = ctx.socket(zmq.ROUTER)  # the first incarnation of P, recording what arrives
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    d = DecodeSideChannel("decode-11", Inbox().deliver, secret=SECRET)
    await nursery.start(d.run)
    for seq in range(3):
        assert d.send(f"127.0.0.1:{port}", Heartbeat(seq, (1,)))
    captured = []
    while len(captured) < 3:
        await _until(lambda: router.poll(0))
        captured.append(router.recv_multipart(zmq.NOBLOCK)[1])
    router.close()
    await trio.sleep(0.01)  # the frames' ms stamps are now strictly before the restart

    inbox = Inbox()
    p, address = await _start_p(nursery, inbox)  # P again: a new process, an empty guard
    sent_at = [int.from_bytes(f[4:12], "big") / 1000 for f in captured]  # signed frames' stamps
    assert p.started_at - 60 < min(sent_at) <= max(sent_at) < p.started_at  # in the window, before
    replayer = _raw_dealer(ctx, address, b"decode-11")
    for frame in captured:
        replayer.send(frame)
    replayer.send(frame_now(Heartbeat(3, (1,)), KEY))  # sent after the restart: accepted
    await _until(lambda: inbox.got)
    assert inbox.got == [("decode-11", Heartbeat(3, (1,)))]
    assert (p.stats.stale, p.stats.replayed, p.stats.malformed) == (3, 0, 0)
    replayer.close()


def _forms(secret: bytes) -> list[bytes]:
    encoded = (secret.hex().encode(), base64.b64encode(secret), base64.urlsafe_b64encode(secret))
    return [secret, *(e.rstrip(b"=") for e in encoded)]


async def test_nothing_either_end_sends_holds_the_secret_or_a_key(
    nursery: trio.Nursery, ctx: Any
) -> None:
    """Every frame D and P put on the wire (read off raw sockets) is signed, and holds neither
    the cluster secret nor the side-channel key nor the registry key, in any common encoding."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    d = DecodeSideChannel("decode-12", Inbox().deliver, secret=SECRET)
    await nursery.start(d.run)
    sent: list[bytes] = []
    for message in (GOOD, Abort(7, "client gone"), Heartbeat(2, tuple(range(100)))):
        assert d.send(f"127.0.0.1:{port}", message)
        await _until(lambda: router.poll(0))
        sent.append(router.recv_multipart(zmq.NOBLOCK)[1])

    p, address = await _start_p(nursery, Inbox())
    dealer = _raw_dealer(ctx, address, b"decode-13")
    dealer.send(frame_now(GOOD, KEY))  # P learns the identity, then answers it
    await _until(lambda: p.stats.received)
    assert p.send("decode-13", HeartbeatAck(incarnation=5, seq=1, failed_rooms=(3,)))
    await _until(lambda: dealer.poll(0))
    sent.append(dealer.recv_multipart(zmq.NOBLOCK)[0])

    forbidden = [f for s in (SECRET, KEY, registry_key(SECRET)) for f in _forms(s)]
    for frame in sent:
        assert frame[3] & 1, "unsigned frame"  # FLAG_SIGNED
        assert decode(frame, KEY) is not None
        assert not [f for f in forbidden if f in frame], frame
    router.close()
    dealer.close()


# ----------------------------------------------------------------------------- CURVE


def _curve_dir(tmp_path: Path, *names: str) -> dict[str, CurveKeys]:
    """A key pair per name; ``trusted/`` holds the public keys of the names not starting with
    "rogue" (what an operator distributes)."""
    trusted = tmp_path / "trusted"
    trusted.mkdir(exist_ok=True)
    keys = {}
    for name in names:
        zmq.auth.create_certificates(tmp_path, name)
        if not name.startswith("rogue"):
            (trusted / f"{name}.key").write_bytes((tmp_path / f"{name}.key").read_bytes())
    for name in names:
        keys[name] = CurveKeys.load(tmp_path / f"{name}.key_secret", trusted)
    return keys


async def _curve_pair(
    nursery: trio.Nursery, p_keys: CurveKeys, d_keys: CurveKeys, identity: str = "d0"
) -> tuple[PrefillSideChannel, DecodeSideChannel, Inbox, Inbox, str]:
    p_inbox, d_inbox = Inbox(), Inbox()
    p, address = await _start_p(nursery, p_inbox, curve=p_keys)
    d = DecodeSideChannel(identity, d_inbox.deliver, secret=SECRET, curve=d_keys)
    await nursery.start(d.run)
    return p, d, p_inbox, d_inbox, address


async def test_curve_round_trip_between_trusted_keys(nursery: trio.Nursery,
                                                     tmp_path: Path) -> None:
    keys = _curve_dir(tmp_path, "p0", "d0")
    p, d, p_inbox, d_inbox, address = await _curve_pair(nursery, keys["p0"], keys["d0"])
    assert d.send(address, GOOD) is False  # P's key not checked yet: D does not dial
    assert d.stats.curve_untrusted_server == 1
    assert d.set_server_key(address, keys["p0"].public.decode()) is None
    assert d.send(address, GOOD)
    await _until(lambda: p_inbox.got)
    assert p_inbox.got == [("d0", GOOD)]
    assert p.send("d0", HeartbeatAck(incarnation=7, seq=1))
    await _until(lambda: d_inbox.got)
    assert d_inbox.got == [(address, HeartbeatAck(incarnation=7, seq=1))]
    assert p.stats.curve_refused == p.stats.handshake_failed == 0


async def test_curve_refuses_untrusted_and_plain_clients(nursery: trio.Nursery, ctx: Any,
                                                         tmp_path: Path) -> None:
    keys = _curve_dir(tmp_path, "p0", "d0", "rogue")
    p, _, p_inbox, _, address = await _curve_pair(nursery, keys["p0"], keys["d0"])
    # A D with a CURVE key P does not trust: refused by ZAP during the handshake.
    rogue = DecodeSideChannel("rogue", Inbox().deliver, secret=SECRET, curve=keys["rogue"])
    await nursery.start(rogue.run)
    # The rogue trusts P (it has P's public key): only P's refusal stops it.
    assert rogue.set_server_key(address, keys["p0"].public.decode()) is None
    assert rogue.send(address, GOOD)
    await _until(lambda: p.stats.curve_refused >= 1)
    # A plain ZMQ client (no CURVE at all), sending a correctly signed frame: the handshake
    # fails on the mechanism; nothing reaches P's core.
    plain = _raw_dealer(ctx, address, b"plain")
    # The failed handshake may already have dropped the pipe (then a send would block): the
    # frame is offered, not required; the handshake alone is what P must refuse.
    with contextlib.suppress(zmq.Again):
        plain.send(frame_now(GOOD, KEY), zmq.NOBLOCK)
    await _until(lambda: p.stats.handshake_failed >= 2)
    await trio.sleep(0.2)
    assert p_inbox.got == []
    assert p.stats.received == 0
    # And P still serves the trusted D.
    d = DecodeSideChannel("d0", Inbox().deliver, secret=SECRET, curve=keys["d0"])
    await nursery.start(d.run)
    assert d.set_server_key(address, keys["p0"].public.decode()) is None
    assert d.send(address, GOOD)
    await _until(lambda: p_inbox.got)


async def test_d_never_dials_a_p_whose_key_it_does_not_trust(nursery: trio.Nursery,
                                                           tmp_path: Path) -> None:
    keys = _curve_dir(tmp_path, "d0", "rogue")
    d = DecodeSideChannel("d0", Inbox().deliver, secret=SECRET, curve=keys["d0"])
    await nursery.start(d.run)
    why = d.set_server_key("10.0.0.9:5000", keys["rogue"].public.decode())
    assert why is not None and "not trusted" in why
    assert "published no CURVE key" in (d.set_server_key("10.0.0.9:5000", None) or "")
    assert not d.send("10.0.0.9:5000", GOOD)
    assert d.peers == [] and d.stats.curve_untrusted_server == 3


def test_curve_key_files_are_checked(tmp_path: Path) -> None:
    zmq.auth.create_certificates(tmp_path, "p0")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CurveError, match="no secret key"):
        CurveKeys.load(tmp_path / "p0.key", tmp_path)
    with pytest.raises(CurveError, match=r"no \*\.key files"):
        CurveKeys.load(tmp_path / "p0.key_secret", tmp_path / "empty")
    with pytest.raises(CurveError, match="not a directory"):
        CurveKeys.load(tmp_path / "p0.key_secret", tmp_path / "missing")


def test_zap_answers_even_a_malformed_request(tmp_path: Path) -> None:
    """A REP socket that skips a reply is stuck: every request gets one (a refusal here)."""
    from pd_fsm.io_trio.side_channel.curve import zap_reply

    keys = _curve_dir(tmp_path, "p0")["p0"]
    assert zap_reply([b"1.0", b"7"], keys) == (
        [b"1.0", b"7", b"500", b"malformed ZAP request", b"", b""], False)
    reply, admitted = zap_reply([b"1.0", b"8", b"d", b"a", b"i", b"NULL"], keys)
    assert reply[:3] == [b"1.0", b"8", b"400"] and not admitted
