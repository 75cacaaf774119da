"""Transport security between hosts: TLS on every HTTP hop, CURVE on the ZMQ side channel, and the
cluster secret signing registry writes and side-channel frames, on two namespaced hosts
(netns_support.py) with a packet capture of host B's link.

Host A (10.77.0.1): bootstrap server (HTTPS, signed writes) and P. Host B (10.77.0.2): D and the
proxy (HTTPS, verifying against the run's CA), and a plain colocated worker on B's loopback for the
reference answers. Every certificate comes from a throwaway CA (``tls.throwaway_ca``); P and D
each have a CURVE key pair and trust each other's public key.

- Answers through the proxy equal the colocated ones, and everything on B's link during those
  requests and the heartbeats after them is ciphertext: the capture (AF_PACKET, every frame of
  B's veth) holds none of the secret, the keys derived from it, the CURVE secret keys, the prompt,
  the registry's JSON field names or an HTTP request line, while it does hold the registry, side
  channel and P traffic (their ports) and, as a control, a marker sent in clear over UDP.
- An intruder on B without the keys: plain HTTP to the bootstrap server and HTTPS without the CA
  fail before any request is read; an unsigned registration over HTTPS gets 401; a plain ZMQ
  client and a CURVE client with an untrusted key never get a frame to P (handshakes refused and
  counted, P's received-frame count unchanged).
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import zmq.auth
from zmq.utils import z85

from pd_fsm.core.keys import registry_key, side_channel_key
from pd_fsm.io_trio.tls import TLS, throwaway_ca
from tests.integration.failure_support import TINY, WINDOWS, cli
from tests.integration.netns_support import (
    Hosts,
    NsClient,
    NsFleet,
    Sniffer,
    namespaces_unavailable,
    tcp_ports,
)

pytestmark = [pytest.mark.slow]

_WHY_NOT = namespaces_unavailable()
if _WHY_NOT is not None:
    pytest.skip(f"separate hosts need network namespaces: {_WHY_NOT}", allow_module_level=True)

BOOT_PORT, P_PORT, P_SIDE, D_PORT, COLOC_PORT, PROXY_PORT = 8998, 30000, 31000, 30001, 30002, 8000
FLAGS = [*TINY, *(x for kv in WINDOWS.items() for x in (kv[0], str(kv[1])))]
MARKER = "Zanzibar-7f3c"  # in every prompt: must never be seen on the wire


@attrs.define
class Secure:
    fleet: NsFleet
    tls: TLS
    secret: bytes
    curve_secrets: list[bytes]
    work: Path

    @property
    def hosts(self) -> Hosts:
        return self.fleet.hosts

    @property
    def client(self) -> NsClient:
        return self.fleet.client

    @property
    def ca(self) -> Path:
        assert self.tls.ca_file is not None
        return self.tls.ca_file

    def url(self, host: str, port: int) -> str:
        return f"https://{host}:{port}"


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secure]:
    work = Path(tmp_path_factory.mktemp("secure"))
    fleet = NsFleet(work)
    hosts = fleet.hosts
    a, b = hosts.ip_a, hosts.ip_b
    try:
        tls = throwaway_ca(work / "tls", [a, b])
        keys = work / "curve"
        trusted = keys / "trusted"
        trusted.mkdir(parents=True)
        curve_secrets = []
        for name in ("p0", "d0"):
            zmq.auth.create_certificates(keys, name)
            (trusted / f"{name}.key").write_bytes((keys / f"{name}.key").read_bytes())
            curve_secrets.append(zmq.auth.load_certificate(keys / f"{name}.key_secret")[1])
        secret = secrets.token_hex(16).encode()
        (work / "cluster.secret").write_bytes(secret + b"\n")

        def secured(name: str) -> list[str]:
            return [*tls.argv(), "--cluster-secret-file", str(work / "cluster.secret"),
                    "--side-channel-curve-key", str(keys / f"{name}.key_secret"),
                    "--side-channel-curve-peers", str(trusted),
                    "--disaggregation-bootstrap-host", a,
                    "--disaggregation-bootstrap-port", str(BOOT_PORT)]

        fleet.start("bootstrap", hosts.a, cli(
            "bootstrap", "--host", a, "--port", str(BOOT_PORT), "--secret-file",
            str(work / "cluster.secret"), "--ssl-certfile", str(tls.certfile),
            "--ssl-keyfile", str(tls.keyfile), "--ttl",
            str(WINDOWS["--disaggregation-bootstrap-heartbeat-ttl"])))
        fleet.start("prefill", hosts.a, cli(
            "serve", *FLAGS, "--disaggregation-mode", "prefill", "--host", a, "--port",
            str(P_PORT), "--disaggregation-side-channel-port", str(P_SIDE), *secured("p0")))
        fleet.start("decode", hosts.b, cli(
            "serve", *FLAGS, "--disaggregation-mode", "decode", "--host", b, "--port",
            str(D_PORT), *secured("d0")))
        fleet.start("colocated", hosts.b, cli("serve", *TINY, "--host", "127.0.0.1", "--port",
                                              str(COLOC_PORT)))
        fleet.wait_ok([f"https://{a}:{BOOT_PORT}/health", f"https://{a}:{P_PORT}/health",
                       f"https://{b}:{D_PORT}/health"], ca=tls.ca_file)
        fleet.wait_ok([f"http://127.0.0.1:{COLOC_PORT}/health"])
        fleet.start("proxy", hosts.b, cli("proxy", "--host", b, "--port", str(PROXY_PORT),
                                          "--bootstrap-url", f"https://{a}:{BOOT_PORT}",
                                          "--refresh-interval", "1", *tls.argv()))
        fleet.wait_ok([f"https://{b}:{PROXY_PORT}/health"], ca=tls.ca_file)
        yield Secure(fleet, tls, secret, curve_secrets, work)
    finally:
        fleet.close()


def _generate(base: str, i: int, ca: Path | None) -> dict[str, Any]:
    return {"method": "POST", "url": f"{base}/generate", "timeout": 60, "ca": ca and str(ca),
            "json": {"text": f"{MARKER} question {i}", "stream": i % 2 == 1,
                     "sampling_params": {"max_new_tokens": 8, "temperature": 0}}}


def _text(answer: dict[str, Any]) -> str:
    assert answer["status"] == 200, answer
    body = answer["body"]
    if body.startswith("data:"):
        body = [c[len("data: "):] for c in body.split("\n\n") if c.startswith("data: {")][-1]
    return str(json.loads(body)["text"])


def _udp_marker(hosts: Hosts, text: str) -> None:
    """The capture's control: a datagram in clear from B to A (nothing listens there)."""
    code = ("import socket, sys; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
            f"s.sendto(sys.argv[1].encode(), ('{hosts.ip_a}', 9))")
    subprocess.run(hosts.exec(hosts.b, [sys.executable, "-c", code, text]), check=True,
                   timeout=30)


def test_everything_on_the_link_is_ciphertext(secure: Secure) -> None:
    env, hosts = secure, secure.hosts
    sniffer = Sniffer(hosts, hosts.b, hosts.if_b, env.work / "link.capture")
    try:
        proxy = env.url(hosts.ip_b, PROXY_PORT)
        pd = env.client.call([_generate(proxy, i, env.ca) for i in range(4)])
        ref = env.client.call([_generate(f"http://127.0.0.1:{COLOC_PORT}", i, None)
                               for i in range(4)])
        assert [_text(a) for a in pd] == [_text(a) for a in ref]
        time.sleep(2.0)  # registry heartbeats (0.5 s) and D -> P heartbeats go by
        _udp_marker(hosts, "control-marker-in-clear")
        time.sleep(0.3)
    finally:
        frames = sniffer.stop()
    wire = b"".join(frames)
    # The capture saw the traffic that matters: registry (HTTPS), side channel (CURVE), P's
    # HTTP leg from the proxy (HTTPS), and the control datagram's payload in clear.
    ports = tcp_ports(frames)
    assert {BOOT_PORT, P_SIDE, P_PORT} <= ports, sorted(ports)
    assert b"control-marker-in-clear" in wire
    derived = [side_channel_key(env.secret), registry_key(env.secret)]
    forbidden = {
        "the cluster secret": [env.secret],
        "a key derived from it": [*derived, *(k.hex().encode() for k in derived)],
        "a CURVE secret key": [*env.curve_secrets, *(z85.decode(k) for k in env.curve_secrets)],
        "the prompt": [MARKER.encode()],
        "a registry JSON field": [b"instance_id", b"heartbeat_ttl", b"zmq_addr"],
        "an HTTP request line": [b"POST /generate", b"PUT /route", b"POST /heartbeat"],
    }
    seen = [what for what, needles in forbidden.items() if any(n in wire for n in needles)]
    assert not seen, f"in clear on the link: {seen}"


def test_an_intruder_without_the_keys_gets_nowhere(secure: Secure) -> None:
    env, hosts = secure, secure.hosts
    boot = f"{hosts.ip_a}:{BOOT_PORT}"
    unsigned = {"role": "prefill", "instance_id": "intruder", "tp_rank": 0, "tp_size": 1,
                "cp_rank": 0, "cp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0,
                "pp_size": 1, "transfer_addr": f"{hosts.ip_b}:7001",
                "zmq_addr": f"{hosts.ip_b}:7002", "page_size": 4, "kv_dtype": "float32"}
    plain, no_ca, no_sig = env.client.call([
        {"method": "PUT", "url": f"http://{boot}/route", "json": unsigned, "timeout": 10},
        {"method": "PUT", "url": f"https://{boot}/route", "json": unsigned, "timeout": 10},
        {"method": "PUT", "url": f"https://{boot}/route", "json": unsigned, "timeout": 10,
         "ca": str(env.ca)},
    ])
    assert plain["status"] is None, plain  # a TLS-only port: no HTTP request is ever read
    assert no_ca["status"] is None and "CERTIFICATE_VERIFY_FAILED" in no_ca["body"], no_ca
    assert no_sig["status"] == 401, no_sig
    listed = env.client.json("GET", f"https://{boot}/list", ca=env.ca)["instances"]
    assert "intruder" not in {r["instance_id"] for r in listed}

    p_info = f"https://{hosts.ip_a}:{P_PORT}/server_info"
    before = env.client.json("GET", p_info, ca=env.ca)["internal_states"][0]["side_channel"]
    rogue_keys = env.work / "rogue"
    rogue_keys.mkdir()
    zmq.auth.create_certificates(rogue_keys, "rogue")
    p_public = zmq.auth.load_certificate(env.work / "curve" / "p0.key")[0].decode()
    code = f"""
import sys, time, zmq, zmq.auth
from pd_fsm.core.codec import encode
from pd_fsm.core.keys import side_channel_key
from pd_fsm.core.messages import Heartbeat
ctx = zmq.Context()
frame = encode(Heartbeat(seq=1, rooms=(1,)), side_channel_key(b"guessed-secret"))
plain = ctx.socket(zmq.DEALER)
plain.connect("tcp://{hosts.ip_a}:{P_SIDE}")
plain.send(frame)
curve = ctx.socket(zmq.DEALER)
pub, sec = zmq.auth.load_certificate("{rogue_keys / 'rogue.key_secret'}")
curve.curve_publickey, curve.curve_secretkey = pub, sec
curve.curve_serverkey = {p_public.encode()!r}
curve.connect("tcp://{hosts.ip_a}:{P_SIDE}")
curve.send(frame)
time.sleep(1.5)
ctx.destroy(linger=0)
"""
    subprocess.run(hosts.exec(hosts.b, [sys.executable, "-c", code]), check=True, timeout=60)
    deadline = time.monotonic() + 10
    while True:
        after = env.client.json("GET", p_info, ca=env.ca)["internal_states"][0]["side_channel"]
        if after["curve_refused"] > before["curve_refused"] and \
                after["handshake_failed"] >= before["handshake_failed"] + 2:
            break
        assert time.monotonic() < deadline, (before, after)
        time.sleep(0.2)
    assert after["malformed"] == before["malformed"]  # no intruder frame got as far as decoding
    # P still serves, through the proxy.
    answer = env.client.call([_generate(env.url(hosts.ip_b, PROXY_PORT), 9, env.ca)])[0]
    assert answer["status"] == 200, answer
