"""Bind one address, advertise another (DESIGN "Addresses").

A worker binds ``--host`` (which may be the wildcard ``0.0.0.0``) and tells the registry the
address peers reach it at: ``--advertise-host IP``, or the IPv4 address of ``--advertise-interface
NAME``, or, when neither is given, ``--host`` itself. Nothing may advertise a wildcard (no peer can
connect to it), and nothing may advertise loopback to a registry on another host (a peer there
would connect to itself). Both are refused at start with the flag to set, and again by the
bootstrap server for records that arrive anyway (:func:`unreachable_from`).
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address
_IFNAMSIZ = 16


class AddressError(ValueError):
    """An address that cannot be advertised, with the flag that fixes it."""


def is_wildcard(host: str) -> bool:
    """True for an address that means "every interface" (never one a peer can dial)."""
    return host in ("", "0.0.0.0", "::", "[::]", "*")


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: whatever it resolves to is the operator's choice


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (Linux), or :class:`AddressError`."""
    if not name or len(name.encode()) >= _IFNAMSIZ:
        raise AddressError(f"--advertise-interface {name!r}: not an interface name")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(
                s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[: _IFNAMSIZ - 1])
            )
        except OSError as exc:
            raise AddressError(
                f"--advertise-interface {name}: no IPv4 address ({exc.strerror})"
            ) from None
    return socket.inet_ntoa(packed[20:24])  # struct ifreq: name[16], then sockaddr_in


def advertised_host(
    bind_host: str, advertise_host: str | None, advertise_interface: str | None,
    *, registry_host: str | None = None,
) -> str:
    """The host peers are told, for a service bound to ``bind_host``.

    ``registry_host`` is where the registrations go (the bootstrap server): advertising loopback
    to a registry that is not on loopback would send every peer on another host to itself.
    """
    if advertise_host is not None and advertise_interface is not None:
        raise AddressError("--advertise-host and --advertise-interface contradict: give one")
    if advertise_interface is not None:
        host = interface_address(advertise_interface)
    elif advertise_host is not None:
        host = advertise_host.strip()
    else:
        host = bind_host
    if is_wildcard(host):
        which = "--advertise-host" if advertise_host is not None else f"--host {bind_host}"
        raise AddressError(
            f"{which} binds every interface and is no address a peer can dial: say which one "
            "peers reach this process at with --advertise-host IP or --advertise-interface NAME"
        )
    # A registry on a unix socket ("unix:PATH") is on this host: loopback reaches its peers.
    if (registry_host is not None and is_loopback(host) and not is_loopback(registry_host)
            and not registry_host.startswith("unix:")):
        raise AddressError(
            f"this process would advertise {host} to the bootstrap server on {registry_host}, "
            "and a peer on another host would dial itself: bind a reachable --host, or give "
            "--advertise-host IP / --advertise-interface NAME"
        )
    return host


def unreachable_from(advertised: str, client_host: str | None) -> str | None:
    """Why a record advertising ``advertised`` (a host) and sent from ``client_host`` cannot be
    reached by the peers it is meant for, or None. The bootstrap server's check."""
    if is_wildcard(advertised):
        return f"advertises the wildcard address {advertised or '(empty)'}, which no peer can dial"
    if client_host is not None and is_loopback(advertised) and not is_loopback(client_host):
        return (
            f"advertises loopback {advertised} but registered from {client_host}: "
            "peers on other hosts would dial themselves (start it with --advertise-host)"
        )
    return None
